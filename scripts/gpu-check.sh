#!/usr/bin/env bash
# `make gpu-check`: on a GPU host, run what Kiln can check of its GPU paths and keep the output
# (docs/gpu.md, "make gpu-check"). Every step runs; the exit status says whether any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=${GPU_CHECK_DIR:-.kiln/gpu-check}
rm -rf "$OUT" && mkdir -p "$OUT"
LOG="$OUT/log.txt"
failed=0

step() {  # step TITLE COMMAND...: run, show and keep the output, remember a failure
    local title=$1
    shift
    printf '\n== %s\n$ %s\n' "$title" "$*" | tee -a "$LOG"
    "$@" 2>&1 | tee -a "$LOG"
    local status=${PIPESTATUS[0]}
    if [ "$status" -ne 0 ]; then
        echo "!! $title failed (exit $status)" | tee -a "$LOG"
        failed=1
    fi
}

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1; } >> "$LOG"
step "which GPU pieces are here" "$BIN/kiln" doctor
step "tests/gpu (a missing GPU fails)" env KILN_REQUIRE_GPU=1 "$BIN/python" -m pytest tests/gpu -v -p no:cacheprovider

backends=$("$BIN/python" -c 'from kiln.workers.engines.select import Host, candidates
print(" ".join(c.backend for c in candidates(Host.probe()) if c.on_gpu))')
echo "GPU backends this host can run: ${backends:-none}" | tee -a "$LOG"
[ -n "$backends" ] || failed=1
for backend in $backends; do
    for model in detector ocr; do
        step "kiln run examples --model $model on $backend" env KILN_ENGINE="$backend" \
            KILN_DATA_DIR="$OUT/$backend" "$BIN/kiln" run examples --model "$model" \
            -o "$OUT/$backend/$model.parquet"
    done
done
step "bench: raw engine vs Kiln from JPEG bytes" "$BIN/python" -m bench --quick \
    --cases raw,embedded --no-readme --workdir "$OUT/bench" --results-dir "$OUT/bench"
step "bench: the feed on the GPU (Kiln vs a DataLoader peer, NVML busy share)" \
    "$BIN/python" -m bench.gpu_feed --workdir "$OUT/gpu-feed" --out "$OUT/gpu-feed.json"
step "bench: the GPU case (native torch, Kiln's engine per batch, kiln run, peer, detector)" \
    "$BIN/python" -m bench.gpu --workdir "$OUT/gpu" --out "$OUT/gpu.json" --markdown "$OUT/gpu.md"

echo "output: $LOG" | tee -a "$LOG"
exit "$failed"
