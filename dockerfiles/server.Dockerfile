# bpsctl summation server (and scheduler) image: slim Python, NumPy, pyzmq, bpsctl; no CUDA.
#   docker build -f dockerfiles/server.Dockerfile -t bpsctl-server .
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# jemalloc: with it a server's RSS does not ratchet up under load (BPSCTL_SERVER_MALLOC); the
# distribution's current package, as in worker.Dockerfile
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libjemalloc2 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/bpsctl
COPY pyproject.toml README.md ./
COPY bpsctl ./bpsctl
# bpsctl's own dependencies are NumPy, pyzmq, psutil, rich and typer
RUN pip install .

USER 1000:1000
# a server by default; the scheduler is the same image with this changed to bpsctl.engine.scheduler
ENTRYPOINT ["python", "-m"]
CMD ["bpsctl.engine.server"]
