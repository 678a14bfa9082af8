#!/usr/bin/env bash
# On a machine with >= 3 CUDA GPUs: the collective data plane over NCCL (same code as the gloo path
# tested on CPU): one sender broadcasts buckets to two receivers, bytes compared by crc32c; then a
# WeightPublisher sends three versions over NCCL to two SyncReceivers, every staged byte compared.
# Usage: bash scripts/gpu_nccl_check.sh   (uses .venv/bin/python unless PYTHON is set)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
n=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$n" -lt 3 ]; then
    echo "needs 3 CUDA GPUs (one per rank), found $n" >&2
    exit 2
fi
"$PY" -m tests.test_collective_plane nccl
