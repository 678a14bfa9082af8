#!/usr/bin/env bash
# The tests marked `gpu` (no vLLM needed), then GPU packing figures, on a CUDA machine:
# - 1+ GPU: trainer tensors held on the GPU reach two receivers bit-exact over shm and ZMQ, staged and
#   streaming (tests/test_gpu_trainer_tensors.py), and how fast packing reads them against the CPU.
# - exactly 1 GPU: NCCL ranks that share it fail the update clearly; ZMQ still applies the next one.
# - 3+ GPUs: the NCCL data plane, publisher to two receivers (also scripts/gpu_nccl_check.sh).
# Usage: bash scripts/gpu_check.sh   (uses .venv/bin/python unless PYTHON is set)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON="${PYTHON:-.venv/bin/python}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
# --noconftest: tests/conftest.py skips every `gpu` test (CPU CI)
"$PYTHON" -m pytest -q -rs -p no:cacheprovider --noconftest -o addopts= -m gpu \
    tests/test_gpu_trainer_tensors.py tests/test_collective_plane.py
"$PYTHON" -m tests.test_gpu_trainer_tensors
n=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$n" -ge 3 ]; then
    bash scripts/gpu_nccl_check.sh
fi
