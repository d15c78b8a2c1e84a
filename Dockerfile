# syntax=docker/dockerfile:1
# One image for every Kiln process; the first argument picks it (see compose.yaml, Procfile):
#   docker run kiln:local api --host 0.0.0.0 --port 8000
#   docker run kiln:local worker --concurrency 8
# GPU workers: build with --build-arg KILN_EXTRAS=gpu (TensorRT, ONNX Runtime CUDA, CuPy, NVML
# from pip wheels); the host needs the NVIDIA driver and container toolkit.

FROM python:3.11-slim AS build
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ARG KILN_EXTRAS=""
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
    && pip install "${wheel}${KILN_EXTRAS:+[$KILN_EXTRAS]}" \
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
