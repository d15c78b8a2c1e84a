#!/usr/bin/env bash
# One short session on a lent GPU host that has CUDA torch but no package index (docs/gpu.md,
# "The offline bundle"): unpack the bundle (scripts/gpu-bundle.sh), start PostgreSQL and Redis
# when its services part is there (so bench.gpu's part f, the service path, runs), then `kiln
# doctor`, tests/gpu and the GPU bench (bench/gpu.py: the native torch module, Kiln's engine per
# batch bucket, kiln run with GPU and CPU decode, the DataLoader peer, the detector, kiln api +
# kiln worker; NVML's busy share beside each), each under its own time limit so one stuck step
# cannot spend the session; bench.gpu also limits each of its parts within GPU_BUDGET_S. Every
# output lands in $OUT (gpu.json, gpu.md, the parts' logs); the services stop at the end.
#   bash scripts/gpu-bundle.sh .gpu services decoder profile (here, before the session)
#   bash scripts/gpu-session.sh .gpu                          (there; the device tool sets $OUT)
# GPU_ARGS adds arguments to bench.gpu (`--skip native,peer`; `--device cpu` tries it all on a
# CPU); TESTS_S, GPU_S, GPU_BUDGET_S and GPU_IMAGES change the limits and the images.
set -uo pipefail
bundle=$(cd "${1:-.gpu}" && pwd) || exit 1
OUT=${OUT:-/tmp/kiln-gpu-out}
mkdir -p "$OUT"
services=()
[ -f "$bundle/services.tar.xz" ] && services=(--services)
# exports PYTHONPATH/PATH (and KILN_DATABASE_URL/KILN_BROKER_URL with --services), cd into the tree
exports=$(bash "$bundle/gpu-unpack.sh" "${services[@]}" "$bundle" 2>"$OUT/unpack.txt")
unpacked=$?
cat "$OUT/unpack.txt"
[ $unpacked -eq 0 ] || exit 1
eval "$exports"
[ ${#services[@]} -gt 0 ] && trap 'bash "$bundle/gpu-unpack.sh" --stop' EXIT
{ date -u; nproc; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } \
    > "$OUT/host.txt" 2>&1
python3 -c 'import torch, torchvision; print(torch.__version__, torchvision.__version__)' \
    >> "$OUT/host.txt" 2>&1
timeout 60 kiln doctor > "$OUT/doctor.txt" 2>&1
echo "doctor: $?"
timeout "${TESTS_S:-150}" python3 -m pytest tests/gpu -q -p no:cacheprovider -rs \
    > "$OUT/tests_gpu.txt" 2>&1
echo "tests/gpu: $?"
tail -n 25 "$OUT/tests_gpu.txt"
read -r -a gpu_args <<<"${GPU_ARGS:-}" # words, as typed
# The outer limit leaves bench.gpu time to write its JSON and table after its own budget.
timeout "${GPU_S:-430}" python3 -m bench.gpu --workdir /tmp/kiln-gpu-bench \
    --out "$OUT/gpu.json" --markdown "$OUT/gpu.md" --images "${GPU_IMAGES:-6000}" \
    --budget "${GPU_BUDGET_S:-400}" "${gpu_args[@]}" > "$OUT/gpu.log" 2>&1
echo "bench.gpu: $?"
cat "$OUT/gpu.md" 2>/dev/null || tail -n 20 "$OUT/gpu.log"
cp /tmp/kiln-gpu-bench/*.log "$OUT/" 2>/dev/null
cp -r /tmp/kiln-gpu-bench/service-logs "$OUT/" 2>/dev/null || true
