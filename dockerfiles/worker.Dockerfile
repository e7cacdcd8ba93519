# bpsctl worker image: CUDA runtime, PyTorch and bpsctl. Build from the repository root:
#   docker build -f dockerfiles/worker.Dockerfile -t bpsctl-worker .
FROM nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# the distribution's current python3 is what we want; pinning Ubuntu package versions breaks
# the build as soon as the archive moves on
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip openssh-client \
    && rm -rf /var/lib/apt/lists/*

# torch first and pinned: its CUDA 12.4 build matches the base image
RUN pip3 install torch==2.5.1 --index-url https://download.pytorch.org/whl/cu124

WORKDIR /opt/bpsctl
COPY pyproject.toml README.md ./
COPY bpsctl ./bpsctl
# the local source tree (its own version), not a package from the registry
# hadolint ignore=DL3013
RUN pip3 install ".[torch]"

# no shell needed to start a worker: `docker run ... bpsctl-worker python3 train.py`
USER 1000:1000
WORKDIR /workspace
CMD ["python3", "-c", "import bpsctl, torch; print('bpsctl', bpsctl.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"]
