#!/usr/bin/env bash
# The GPU measurements of the results pages, in one short run on a machine with one NVIDIA GPU and a CUDA
# torch: how fast the training process assembles batches there (benchmarks/batch_assembly.py), the paper-model
# study of configs/study-paper-gpu.yaml, then, with the time left, the privacy step's cost at the paper's input
# and batch (benchmarks/dp_step.py) and a TensorRT engine if TensorRT is installed. Each part has its own time
# limit, so that what finished is kept when a later part runs out of time.
#
#   OUT=/tmp/gpu SECONDS_TOTAL=560 bash benchmarks/gpu_session.sh     # results and the log under $OUT
#
# fedpose runs as installed, from a wheel of this tree (built here; one already in .whl/ only if that fails),
# from a scratch folder, so that the repository's own fedpose/ folder does not stand in front of it. Packages
# the machine lacks (opacus) can be put in .whl/ as wheels; everything there is installed to /tmp/site.
# Nothing is downloaded. STUDY_CONFIG names another study file (a CPU dry run of this script uses a small one).
# The installed copy has no git beside it, so the records name the commit in FEDPOSE_SOURCE_COMMIT: taken from
# the checkout's git when there is one, else give it (a copy of the tree without .git):
#   FEDPOSE_SOURCE_COMMIT=$(git rev-parse HEAD) OUT=/tmp/gpu bash benchmarks/gpu_session.sh
set -u
OUT=${OUT:-/tmp/fedpose-gpu}
TOTAL=${SECONDS_TOTAL:-560}
REPO=$(cd "$(dirname "$0")/.." && pwd)
STUDY_CONFIG=${STUDY_CONFIG:-$REPO/configs/study-paper-gpu.yaml}
WORK=${WORK:-/tmp/fedpose-gpu-work}
mkdir -p "$OUT" "$WORK"
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
left() { echo $((TOTAL - SECONDS)); }

cd "$REPO" || exit 1
FEDPOSE_SOURCE_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo "${FEDPOSE_SOURCE_COMMIT:-}")
export FEDPOSE_SOURCE_COMMIT
echo "source commit: ${FEDPOSE_SOURCE_COMMIT:-unknown (set FEDPOSE_SOURCE_COMMIT)}"
if ! python3 -m pip wheel -q --no-deps --no-build-isolation --no-index -w .whl .; then
    compgen -G ".whl/fedpose-*.whl" > /dev/null || exit 1
    echo "WARNING: fedpose's wheel could not be built here: using the one in .whl/, which must be of this tree"
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
cd "$WORK" || exit 1
python3 -c "import fedpose.shared, sys; print('fedpose from', fedpose.shared.__file__)" || exit 1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import os, torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU', 'cpus', os.cpu_count())"
date -u +"start %H:%M:%S"

echo "== batch assembly on this machine's CPU (256 crops at 256x192 from 320 px images)"
timeout 60 python3 "$REPO/benchmarks/batch_assembly.py" --threads 1,16 --batch 256 --rounds 2 \
    --out "$OUT/batch_assembly.json"

echo "== the paper-model study ($STUDY_CONFIG), $(left) s left"
timeout -s TERM -k 20 "$(( $(left) - 60 ))" python3 -m fedpose.cli.main study --config "$STUDY_CONFIG" \
    --out runs/study-paper-gpu --jobs 2 --record runs/study-paper-gpu-record
python3 -m fedpose.cli.main study --config "$STUDY_CONFIG" --out runs/study-paper-gpu --report-only --quiet
tar -czf "$OUT/study-paper-gpu.tar.gz" runs/study-paper-gpu-record runs/study-paper-gpu/*.md runs/study-paper-gpu/*.csv \
    runs/study-paper-gpu/cells/*/log.txt runs/study-paper-gpu/cells/*/metrics.json 2> /dev/null
date -u +"study done %H:%M:%S, $(left) s left"

echo "== TensorRT"
if python3 -c "import tensorrt" 2> /dev/null; then
    python3 -m fedpose.cli.main edge export --checkpoint runs/pretrained-paper-gpu/model.pt --out runs/paper.onnx \
        --input 256x192 &&
        timeout 120 python3 -m fedpose.cli.main edge build --onnx runs/paper.onnx --out "$OUT/paper-fp16.plan" \
            --precision fp16
else
    echo "TensorRT is not installed on this machine: no engine built"
fi

if [ "$(left)" -gt 60 ]; then
    echo "== the DP step on the GPU (tinyvit-5m finetune, 256x192, batch 256, chunk 32), $(left) s left"
    # from the checkout, to the path the results page reads (the command it records names no path of this machine)
    (cd "$REPO" && timeout "$(( $(left) - 15 ))" python3 benchmarks/dp_step.py --device cuda --variants tinyvit-5m \
        --repeats 5 --input 256x192 --batch 256 --chunk 32 --out benchmarks/results/dp_step_cuda.json &&
        cp benchmarks/results/dp_step_cuda.json "$OUT/")
fi
date -u +"end %H:%M:%S"
