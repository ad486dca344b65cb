#!/usr/bin/env bash
# The session-5 recordings of bench/RESULTS.md ("Recording 4"), in the order they were taken: every weight
# format against llama.cpp in one run, context scaling with fp32 and int8 KV against llama.cpp in one run,
# Gemma-3, the batch-16 roofline row, then the final single-stream runs after the prefill fixes.
# Needs llama-cpp-python in .venv (pip install -c constraints.txt llama-cpp-python). About 20 minutes on
# 2 cores; run it on a quiet machine (each JSON file records the load average before and after).
set -euo pipefail
cd "$(dirname "$0")/../.."
B=".venv/bin/bytediet bench --threads 2"
OUT=bench/results
$B --parts single --peers llama.cpp --formats fp32,int8,int4-g64,mxfp4,sparse24-int8 \
   --json --out $OUT/bench-formats-smollm2.json > /dev/null
$B --parts context --contexts 2048,8192 --peers llama.cpp --formats gguf:int8 \
   --json --out $OUT/bench-context-smollm2.json > /dev/null
$B --model gemma3-270m --parts single --peers llama.cpp --json --out $OUT/bench-single-gemma3-wave5.json > /dev/null
$B --parts roofline --roofline-batches 16 --peers none --json --out $OUT/bench-roofline-wave5.json > /dev/null
# after the prefill fixes (float GEMM on the decoded weight for ≥ 64-row products, torch threads for prefill steps)
$B --parts single --peers llama.cpp --json --out $OUT/bench-single-smollm2-final.json > /dev/null
$B --model gemma3-270m --parts single --peers llama.cpp --json --out $OUT/bench-single-gemma3-final.json > /dev/null
