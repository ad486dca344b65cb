#!/usr/bin/env bash
# The session-9 recordings of bench/RESULTS.md ("Recording 9", Zen 5 VM with AVX-512 VNNI/BF16): the int8 panel
# GEMM on q16 activations as the default prefill product, native attention for prefill chunks, native RMSNorm,
# and libgomp's spin shortened (bytediet/__init__.py). Both models single stream against llama.cpp, twice each;
# Gemma-3 with the old fp32 prefill GEMM for comparison; the batch-16 roofline rows (64- and 2048-token
# contexts); context scaling at 2k/4k/8k with fp32, int8 and turboquant3.5 KV; SmolLM2 for every weight format.
# Needs llama-cpp-python in .venv (pip install -c constraints.txt llama-cpp-python). About 25 minutes on 2 cores;
# run it on a quiet machine (each JSON file records the load average before and after).
set -euo pipefail
cd "$(dirname "$0")/../.."
B=".venv/bin/bytediet bench --threads 2"
OUT=bench/results
for rep in 1 2; do
  $B --parts single --peers llama.cpp --json --out $OUT/bench-single-smollm2-wave9-$rep.json > /dev/null
  $B --model gemma3-270m --parts single --peers llama.cpp --json --out $OUT/bench-single-gemma3-wave9-$rep.json > /dev/null
done
BYTEDIET_PREFILL_GEMM=fp32 $B --model gemma3-270m --parts single --peers llama.cpp \
   --json --out $OUT/bench-single-gemma3-fp32gemm-wave9.json > /dev/null
$B --parts roofline --roofline-batches 1,16 --peers none --json --out $OUT/bench-roofline-wave9.json > /dev/null
$B --parts roofline --roofline-batches 16 --roofline-context 2048 --peers none \
   --json --out $OUT/bench-roofline-2k-wave9.json > /dev/null
$B --parts context --contexts 2048,4096,8192 --peers llama.cpp --formats gguf:int8,gguf:turboquant3.5 \
   --json --out $OUT/bench-context-smollm2-wave9.json > /dev/null
$B --parts single --peers llama.cpp --formats fp32,int8,int4-g64,fp8,sparse24,int8-w8a8,mxfp4 \
   --json --out $OUT/bench-formats-smollm2-wave9.json > /dev/null
