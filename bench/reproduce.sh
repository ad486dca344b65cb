#!/usr/bin/env bash
# Makes every number of the current table at the top of bench/RESULTS.md, one JSON file per row group, in
# bench/results/current-<date>/ (or $OUT). Run it on a quiet machine: about 40 minutes on 2 cores; each file records
# the load average before and after. Needs llama-cpp-python in .venv (pip install -c constraints.txt
# llama-cpp-python) and, for the concurrency and server rows, llama-server (bench/build_llama_server.sh).
#
#   bench/reproduce.sh             # the whole table
#   bench/reproduce.sh --dry-run   # print the commands only
#   bench/reproduce.sh --quick     # every command with bytediet bench's tiny workloads (minutes; numbers meaningless)
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
QUICK=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --quick) QUICK=(--quick) ;;
    *) echo "usage: bench/reproduce.sh [--dry-run] [--quick]" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-bench/results/current-$(date -u +%Y%m%d-%H%M)}
B=(.venv/bin/bytediet bench --threads 2 "${QUICK[@]}")

run() {  # print a command, then run it unless --dry-run (the JSON goes to --out, not the terminal)
  echo "+ $*" >&2
  if [[ $DRY == 0 ]]; then "$@" > /dev/null; fi
}
[[ $DRY == 1 ]] || mkdir -p "$OUT"

# prefill 512 tokens and batch-1 decode against llama.cpp in the same process, both models
run "${B[@]}" --parts single --peers llama.cpp --json --out "$OUT/single-smollm2.json"
run "${B[@]}" --model gemma3-270m --parts single --peers llama.cpp --json --out "$OUT/single-gemma3.json"
# batch-1 decode at 2k / 4k / 8k context, fp32 and q4_0 KV, against llama.cpp (f16 KV); then the avx2 variant
run "${B[@]}" --parts context --contexts 2048,4096,8192 --peers llama.cpp --formats gguf:q4_0 \
    --json --out "$OUT/context-smollm2.json"
run env BYTEDIET_KERNELS=avx2 "${B[@]}" --parts context --contexts 2048,8192 --peers llama.cpp \
    --json --out "$OUT/context-smollm2-avx2.json"
# throughput at concurrency 1 / 4 / 16 / 64 on the bench's workload against llama-server
run "${B[@]}" --parts concurrency --peers llama.cpp --concurrency 1,4,16,64 --json --out "$OUT/concurrency-llama-server.json"
# the server under load: 1 / 4 / 16 / 64 streaming clients × 10 requests of 32 tokens, both servers, with plots
if [[ ${#QUICK[@]} == 0 ]]; then
  run sh -c "PYTHONPATH=src .venv/bin/python bench/server_load.py --system both --clients 1,4,16,64 --requests 10 \
--max-tokens 32 --threads 2 --plot $OUT/server-load.png --json > $OUT/server-load.json"
fi
# single stream and concurrency 64 against transformers (float32)
run "${B[@]}" --parts single,concurrency --peers transformers --concurrency 64 --json --out "$OUT/transformers.json"
# the batch-16 decode step against the roofline's prediction, at 73 and 2057 tokens of context
run "${B[@]}" --parts roofline --roofline-batches 16 --peers none --json --out "$OUT/roofline.json"
run "${B[@]}" --parts roofline --roofline-batches 16 --roofline-context 2048 --peers none \
    --json --out "$OUT/roofline-2k.json"
[[ $DRY == 1 ]] || echo "bench/reproduce.sh: results in $OUT"
