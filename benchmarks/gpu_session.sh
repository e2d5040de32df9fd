#!/usr/bin/env bash
# The GPU measurements of the results pages, in one short run on a machine with one NVIDIA GPU and a CUDA
# torch (the privacy step's cost at the paper's input and batch, then the paper-model study of
# configs/study-paper-gpu.yaml, then a TensorRT engine if TensorRT is installed). Each part has its own time
# limit, so that what finished is kept when a later part runs out of time.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh     # results and the log under $OUT
#
# Packages the machine lacks can be put in .whl/ as wheels (opacus, pycocotools); they are installed to
# /tmp/site first. Nothing is downloaded.
set -u
OUT=${OUT:-/tmp/fedpose-gpu}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
FEDPOSE=(python3 -c "import sys; from cli.main import main; sys.argv[0] = 'fedpose'; sys.exit(main())")

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'cpus', __import__('os').cpu_count())"
date -u +"start %H:%M:%S"

echo "== the DP step on the GPU (tinyvit-5m finetune, 256x192, batch 256, chunk 32)"
[ "${STEP_SECONDS:-150}" = 0 ] || timeout "${STEP_SECONDS:-150}" python3 benchmarks/dp_step.py --device cuda --variants tinyvit-5m --repeats 10 \
    --input 256x192 --batch 256 --chunk 32 --out "$OUT/dp_step_cuda.json"
date -u +"step done %H:%M:%S"

echo "== the paper-model study (configs/study-paper-gpu.yaml)"
timeout "${STUDY_SECONDS:-420}" "${FEDPOSE[@]}" study --config configs/study-paper-gpu.yaml --out runs/study-paper-gpu \
    --jobs 1 --record runs/study-paper-gpu-record
tar -czf "$OUT/study-paper-gpu.tar.gz" -C runs study-paper-gpu-record \
    $(cd runs && ls study-paper-gpu/*.md study-paper-gpu/*.csv 2>/dev/null)
date -u +"study done %H:%M:%S"

echo "== TensorRT (the paper model from the study's pretraining, 256x192, fp16)"
if python3 -c "import tensorrt" 2> /dev/null; then
    "${FEDPOSE[@]}" edge export --checkpoint runs/pretrained-paper-gpu/model.pt --out runs/paper.onnx --input 256x192 &&
        timeout "${TRT_SECONDS:-120}" "${FEDPOSE[@]}" edge build --onnx runs/paper.onnx --out "$OUT/paper-fp16.plan" \
            --precision fp16
else
    echo "TensorRT is not installed on this machine: no engine built"
fi
date -u +"end %H:%M:%S"
