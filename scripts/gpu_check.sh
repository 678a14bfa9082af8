#!/usr/bin/env bash
# The checks marked `gpu` in tests/, on a CUDA machine; no vLLM needed.
# - 1+ GPU: trainer tensors held on the GPU reach two receivers bit-exact over shm and ZMQ, staged and
#   streaming (tests/test_gpu_trainer_tensors.py), then how fast packing reads them against the CPU.
# - 3+ GPUs: the NCCL data plane (scripts/gpu_nccl_check.sh; NCCL refuses two ranks on one GPU).
# Usage: bash scripts/gpu_check.sh   (uses .venv/bin/python unless PYTHON is set)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON="${PYTHON:-.venv/bin/python}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
"$PYTHON" -m tests.test_gpu_trainer_tensors
n=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$n" -ge 3 ]; then
    bash scripts/gpu_nccl_check.sh
else
    echo "NCCL data plane skipped: needs 3 GPUs (one per rank), found $n"
fi
