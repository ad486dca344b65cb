#!/usr/bin/env bash
# The session-6 recordings of bench/RESULTS.md ("Recording 6") and bench/KV_RESULTS.md, in the order taken:
# context scaling (2k/4k/8k) with fp32, int8 and turboquant3.5 KV against llama.cpp in one run, Gemma-3
# single stream, the batch-16 roofline row at 2k context, and SmolLM2's single stream for every weight format.
# Needs llama-cpp-python in .venv (pip install -c constraints.txt llama-cpp-python). About 20 minutes on
# 2 cores; run it on a quiet machine (each JSON file records the load average before and after).
set -euo pipefail
cd "$(dirname "$0")/../.."
B=".venv/bin/bytediet bench --threads 2"
OUT=bench/results
$B --parts context --contexts 2048,4096,8192 --peers llama.cpp --formats gguf:int8,gguf:turboquant3.5 \
   --json --out $OUT/bench-context-smollm2-wave6.json > /dev/null
$B --model gemma3-270m --parts single --peers llama.cpp --json --out $OUT/bench-single-gemma3-wave6.json > /dev/null
$B --parts roofline --roofline-batches 16 --roofline-context 2048 --peers none \
   --json --out $OUT/bench-roofline-2k-wave6.json > /dev/null
$B --parts single --peers llama.cpp --formats fp32,int8,int4-g64,fp8,sparse24,int8-w8a8,mxfp4 \
   --json --out $OUT/bench-formats-smollm2-wave6.json > /dev/null
