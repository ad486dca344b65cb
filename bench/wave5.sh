#!/usr/bin/env bash
# The session-5 recordings of bench/RESULTS.md ("Recording 4"): every weight format against llama.cpp in one
# run, context scaling with fp32 and int8 KV against llama.cpp in one run, Gemma-3, the batch-16 roofline row.
# Needs llama-cpp-python in .venv (pip install -c constraints.txt llama-cpp-python). About 12 minutes on
# 2 cores; run it on a quiet machine (the load average is printed before and after each part).
set -euo pipefail
cd "$(dirname "$0")/.."
B=".venv/bin/bytediet bench --threads 2"
OUT=bench/results
uptime
$B --parts single --peers llama.cpp --formats fp32,int8,int4-g64,mxfp4,sparse24-int8 \
   --json --out $OUT/bench-formats-smollm2.json > /dev/null
uptime
$B --parts context --contexts 2048,8192 --peers llama.cpp --formats gguf:int8 \
   --json --out $OUT/bench-context-smollm2.json > /dev/null
uptime
$B --model gemma3-270m --parts single --peers llama.cpp --json --out $OUT/bench-single-gemma3-wave5.json > /dev/null
uptime
$B --parts roofline --roofline-batches 16 --peers none --json --out $OUT/bench-roofline-wave5.json > /dev/null
uptime
