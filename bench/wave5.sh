#!/usr/bin/env bash
# The session-5 recordings of bench/RESULTS.md ("Recording 4"): every weight format against llama.cpp in one
# run, context scaling with fp32 and int8 KV, Gemma-3, the batch-16 roofline row. Needs llama-cpp-python in
# .venv (pip install -c constraints.txt llama-cpp-python). About 20 minutes on 2 cores; run on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
B=".venv/bin/bytediet bench --threads 2"
OUT=bench/results
uptime
$B --parts single --peers llama.cpp --formats gguf,fp32,int8,int4-g64,int4-g32,mxfp4,nvfp4,sparse24-int8 \
   --json --out $OUT/bench-formats-smollm2.json > /dev/null
uptime
$B --parts context --contexts 2048,4096,8192 --peers llama.cpp --json --out $OUT/bench-context-fp32.json > /dev/null
uptime
$B --parts context --contexts 2048,8192 --peers none --kv-cache-dtype int8 --json --out $OUT/bench-context-int8.json > /dev/null
uptime
$B --model gemma3-270m --parts single --peers llama.cpp --json --out $OUT/bench-single-gemma3-wave5.json > /dev/null
uptime
$B --parts roofline --roofline-batches 1,16 --peers none --json --out $OUT/bench-roofline-wave5.json > /dev/null
uptime
