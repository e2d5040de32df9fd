#!/usr/bin/env bash
# The paper's setting end to end on one NVIDIA GPU, with the GPU's side of the batch and step measurements, in
# one prepared run. How long each part takes on one H200 (measured there where it says so; "est." is worked out
# from the step times measured there, docs/results/benchmarks.md, and is not a measurement of this script):
#   0. fedpose installed from a wheel of this tree; nvidia-smi, torch                         seconds
#   1. batch assembly of every kind, per image on the CPU and on the GPU (batch_assembly.py)   60 s at most
#   2. the paper-setting study, configs/study-paper-gpu-500.yaml (--jobs 2: two cells at once on the one GPU):
#      the ward, 5,500 images at 320 px, generated once into $WORK                            about 1 min (est.)
#      the public start: 320 steps of 64 (or a stored start in $WORK/runs/pretrained-paper-gpu) 1.8 min measured
#      the record-level recipe (proj, raw+psi: 512 rows a step), 516 steps of 256, PCKh        3.3-10.1 min (est.)
#      fpdp, 516 steps of 256, PCKh (beside the recipe)                                        2.3-6.8 min (est.)
#      non-private, 516 steps of 256, PCKh                                                     0.8-3.8 min (est.)
#      (low end: the GPU sets the pace, 2 x 193.0 ms a recipe step, 268.4 ms FP-DP, 91.6 ms non-private per 256
#      images; high end: the step still waits for the CPU, as the 204-step run did: 4.0, 2.7 and 1.5 minutes)
#   3. the DP step at batch 256, 256x192, chunk 32 (dp_step.py --device cuda), with the time left   1-2 min (est.)
#      then chunks of 32 beside chunks sized from the free memory, at most 256 (dp_step.py --chunks) 1-2 min (est.)
#   4. a TensorRT engine, if TensorRT is installed                                             2 min at most
# The study keeps each finished cell in $OUT/study-paper-gpu-500-record and counts it as done: a rerun with the
# same OUT and WORK resumes where a time limit cut it off.
#
#   OUT=/tmp/gpu SECONDS_TOTAL=560 bash benchmarks/gpu_session.sh     # results and the log under $OUT
#   DRY_RUN=1 OUT=/tmp/gpu-dry bash benchmarks/gpu_session.sh         # every step at toy sizes on a CPU, minutes
#
# fedpose runs as installed, from a wheel of this tree (built here; one already in .whl/ only if that fails),
# from a scratch folder, so that the repository's own fedpose/ folder does not stand in front of it. Packages
# the machine lacks (opacus) can be put in .whl/ as wheels; everything there is installed to $WORK/site.
# Nothing is downloaded. STUDY_CONFIG names another study file.
# The installed copy has no git beside it, so the records name the commit in FEDPOSE_SOURCE_COMMIT: taken from
# the checkout's git when there is one, else give it (a copy of the tree without .git):
#   FEDPOSE_SOURCE_COMMIT=$(git rev-parse HEAD) OUT=/tmp/gpu bash benchmarks/gpu_session.sh
set -u
DRY_RUN=${DRY_RUN:-0}
OUT=${OUT:-/tmp/fedpose-gpu}
TOTAL=${SECONDS_TOTAL:-560}
REPO=$(cd "$(dirname "$0")/.." && pwd)
STUDY_CONFIG=${STUDY_CONFIG:-$REPO/configs/study-paper-gpu-500.yaml}
WORK=${WORK:-/tmp/fedpose-gpu-work}
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
left() { echo $((TOTAL - SECONDS)); }
if [ "$DRY_RUN" = 1 ]; then  # toy sizes on the CPU: the same steps, the study's quick grid
    DEVICE=cpu ASSEMBLY=(--threads 1 --batch 8 --images 8 --rounds 1) QUICK=(--quick)
else
    DEVICE=cuda ASSEMBLY=(--threads 1,16 --batch 256 --rounds 2) QUICK=()
fi

cd "$REPO" || exit 1
FEDPOSE_SOURCE_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo "${FEDPOSE_SOURCE_COMMIT:-}")
export FEDPOSE_SOURCE_COMMIT
echo "source commit: ${FEDPOSE_SOURCE_COMMIT:-unknown (set FEDPOSE_SOURCE_COMMIT)}"
if ! python3 -m pip wheel -q --no-deps --no-build-isolation --no-index -w .whl .; then
    compgen -G ".whl/fedpose-*.whl" > /dev/null || exit 1
    echo "WARNING: fedpose's wheel could not be built here: using the one in .whl/, which must be of this tree"
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    .whl/*.whl || exit 1
export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
cd "$WORK" || exit 1
python3 -c "import fedpose.shared, sys; print('fedpose from', fedpose.shared.__file__)" || exit 1

if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
python3 -c "import os, torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU', 'cpus', os.cpu_count())"
date -u +"start %H:%M:%S"

echo "== 1. batch assembly, per image on the CPU and on $DEVICE (256x192 crops from 320 px images)"
timeout 60 python3 "$REPO/benchmarks/batch_assembly.py" "${ASSEMBLY[@]}" --device "$DEVICE" \
    --out "$OUT/batch_assembly_gpu.json"

echo "== 2. the paper-setting study ($STUDY_CONFIG ${QUICK[*]}), $(left) s left"
RECORD=$OUT/study-paper-gpu-500-record
timeout -s TERM -k 20 "$(( $(left) - 60 ))" python3 -m fedpose.cli.main study --config "$STUDY_CONFIG" \
    "${QUICK[@]}" --out runs/study-paper-gpu-500 --jobs 2 --record "$RECORD"
python3 -m fedpose.cli.main study --config "$STUDY_CONFIG" "${QUICK[@]}" --out runs/study-paper-gpu-500 \
    --record "$RECORD" --report-only --quiet
tar -czf "$OUT/study-paper-gpu-500.tar.gz" runs/study-paper-gpu-500/*.md runs/study-paper-gpu-500/*.csv \
    runs/study-paper-gpu-500/cells/*/log.txt runs/study-paper-gpu-500/cells/*/metrics.json 2> /dev/null
date -u +"study done %H:%M:%S, $(left) s left"

if [ "$(left)" -gt 60 ]; then
    echo "== 3. the DP step on $DEVICE (tinyvit-5m finetune, 256x192, batch 256, chunk 32), $(left) s left"
    if [ "$DEVICE" = cuda ]; then
        # from the checkout, to the path the results page reads (the command it records names no path of this machine)
        (cd "$REPO" && timeout "$(( $(left) - 15 ))" python3 benchmarks/dp_step.py --device cuda --variants tinyvit-5m \
            --repeats 5 --input 256x192 --batch 256 --chunk 32 --out benchmarks/results/dp_step_cuda.json &&
            cp benchmarks/results/dp_step_cuda.json "$OUT/")
    else  # its CUDA mode needs a GPU; the dry run checks that it starts and reads these arguments
        python3 "$REPO/benchmarks/dp_step.py" --help > /dev/null && echo "dry run: benchmarks/dp_step.py --device cuda" \
            "--variants tinyvit-5m --repeats 5 --input 256x192 --batch 256 --chunk 32 would run here"
    fi
fi
if [ "$(left)" -gt 60 ]; then
    echo "== 3b. the DP step's chunk sized from the free memory on $DEVICE (at most 256, beside 32), $(left) s left"
    if [ "$DEVICE" = cuda ]; then
        (cd "$REPO" && timeout "$(( $(left) - 15 ))" python3 benchmarks/dp_step.py --chunks --device cuda \
            --variants tinyvit-5m --repeats 5 --input 256x192 --batch 256 --fixed 32 --cap 256 \
            --out benchmarks/results/dp_step_chunks_cuda.json && cp benchmarks/results/dp_step_chunks_cuda.json "$OUT/")
    else
        echo "dry run: benchmarks/dp_step.py --chunks --device cuda --variants tinyvit-5m --repeats 5 --input 256x192" \
            "--batch 256 --fixed 32 --cap 256 would run here"
    fi
fi

echo "== 4. TensorRT"
if python3 -c "import tensorrt" 2> /dev/null; then
    python3 -m fedpose.cli.main edge export --checkpoint runs/pretrained-paper-gpu/model.pt --out runs/paper.onnx \
        --input 256x192 &&
        timeout 120 python3 -m fedpose.cli.main edge build --onnx runs/paper.onnx --out "$OUT/paper-fp16.plan" \
            --precision fp16
else
    echo "TensorRT is not installed on this machine: no engine built"
fi
date -u +"end %H:%M:%S"
