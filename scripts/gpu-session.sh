#!/usr/bin/env bash
# One short session on a lent GPU host that has CUDA torch but no package index
# (../shared/gpu/README.md): unpack the offline bundle, then the GPU feed bench (kiln run
# against a DataLoader peer, the GPU's busy share from NVML) and tests/gpu, each under its own
# time limit so one stuck step cannot spend the session. Every output lands in $OUT.
#   bash scripts/gpu-session.sh BUNDLE_DIR          (the device tool sets $OUT)
set -uo pipefail
bundle=$(cd "${1:-.gpu}" && pwd)
OUT=${OUT:-/tmp/kiln-gpu-out}
mkdir -p "$OUT"
eval "$(bash "$bundle/unpack.sh" "$bundle")"   # exports PYTHONPATH/PATH, cd into the tree
{ date -u; nproc; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } \
    > "$OUT/host.txt" 2>&1
python3 -c 'import torch, torchvision; print(torch.__version__, torchvision.__version__)' \
    >> "$OUT/host.txt" 2>&1
timeout 60 kiln doctor > "$OUT/doctor.txt" 2>&1
echo "doctor: $?"
timeout "${FEED_S:-270}" python3 -m bench.gpu_feed --workdir /tmp/kiln-gpu-feed \
    --out "$OUT/gpu_feed.json" --images "${FEED_IMAGES:-4500}" > "$OUT/gpu_feed.log" 2>&1
echo "gpu_feed: $?"
tail -n 6 "$OUT/gpu_feed.log"
cp /tmp/kiln-gpu-feed/*.log "$OUT/" 2>/dev/null
timeout "${TESTS_S:-150}" python3 -m pytest tests/gpu -q -p no:cacheprovider -rs \
    > "$OUT/tests_gpu.txt" 2>&1
echo "tests/gpu: $?"
tail -n 25 "$OUT/tests_gpu.txt"
