# The pdserve image: router, prefill and decode workers and the tools (`pdserve ...`), one image
# per torch flavor. docker-compose.yml builds both; by hand:
#
#   CPU   docker build -t pdserve:cpu .
#   CUDA  docker build -t pdserve:cuda \
#           --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04 \
#           --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# then `docker run --rm pdserve:cpu router --help`. See docs/deploy.md.

# python:*-slim for CPU. For CUDA a nvidia/cuda *-base-* image: torch's wheels bring the CUDA
# runtime, the base adds the NVIDIA_* defaults and the forward-compatibility libraries.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# Torch wheel index: .../whl/cpu, or .../whl/cu128 (cu126, cu124: older torch, older drivers).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Empty: the newest torch on that index.
ARG TORCH_VERSION=

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    TOKENIZERS_PARALLELISM=false

# gcc + libc headers: Triton compiles its launcher stubs when a worker starts (CUDA flavor);
# g++ + ninja: the CPU kernels (kernels/cpp_build.py) are built at a worker's first start
# (without them every CPU worker fell back to the torch reference path, with a warning).
# python3 (+ venv, headers for Triton) only when the base image has none (nvidia/cuda).
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates gcc g++ libc6-dev ninja-build \
 && if ! command -v python3 >/dev/null 2>&1; then \
      apt-get install -y --no-install-recommends python3 python3-venv python3-dev; \
    fi \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && useradd --create-home --uid 10001 --shell /bin/bash pdserve \
 && mkdir -p /models /var/lib/pdserve/gpu-claims /run/pdserve \
 && chown pdserve:pdserve /models /var/lib/pdserve/gpu-claims /run/pdserve \
 && chmod 0700 /run/pdserve

# Layers in order of how rarely they change: torch, then the dependencies declared in
# pyproject.toml (installed from a copy of it alone, with no packages yet), then the source.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch${TORCH_VERSION:+==${TORCH_VERSION}}"

WORKDIR /app
COPY pyproject.toml README.md ./
# The CPU image must keep the CPU torch: a dependency that asked for another torch version
# would have pip replace it with PyPI's, on Linux x86_64 the multi-GB CUDA build.
RUN pip install -e '.[engine,nixl]' \
 && python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
 && case "${TORCH_INDEX_URL%/}" in \
      */whl/cpu) python -c "import sys, torch; sys.exit(torch.version.cuda and 'CPU image, but torch ' + torch.__version__ + ' is a CUDA build')" ;; \
    esac

COPY . .
RUN pip install --no-deps -e . \
 && chmod 0755 deploy/docker/entrypoint.sh deploy/docker/model-init.sh \
 && python -c "import shared.engine, router, kvtransfer.ucx, kvtransfer.nixl_agent as n; n.nixl_bindings()" \
 && pdserve router --help >/dev/null

USER pdserve
# Engine workers: gRPC (prefill 50061, decode 50051), Prometheus /metrics 9100, decode UCX
# listener 13337. Router: HTTP 8000.
EXPOSE 8000 50051 50061 9100 13337
ENTRYPOINT ["/app/deploy/docker/entrypoint.sh"]
CMD ["--help"]
