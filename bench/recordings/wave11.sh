#!/usr/bin/env bash
# The session-11 recordings of bench/RESULTS.md ("Recording 11"): the streaming attention passes on the avx2
# variant too (Lanes8 kernels under the same address-order walk), llama.cpp's KV blocks (q8_0, q5_0, q4_1, q4_0)
# widened in registers by both variants, and auto:<bits> plans in the native decode step (TurboQuant on one side
# of a layer beside row or block pages). Context scaling at 2k/4k/8k with fp32, int8, q8_0, rot-q8_0, q4_0 and the
# budgets auto:6.5 / auto:4.5 (planned by bench on 1 × 512 tokens) against llama.cpp (AVX-512 variant, then the
# avx2 variant forced with BYTEDIET_KERNELS=avx2), and every row/block codec's write + attention per layer at 8k.
# Needs llama-cpp-python in .venv (pip install -c constraints.txt llama-cpp-python). About 20 minutes on 2 cores;
# run it on a quiet machine (each JSON file records the load average before and after).
set -euo pipefail
cd "$(dirname "$0")/../.."
B=".venv/bin/bytediet bench --threads 2"
OUT=bench/results
$B --parts context --contexts 2048,4096,8192 --peers llama.cpp \
   --formats gguf:int8,gguf:q8_0,gguf:rot-q8_0,gguf:q4_0,gguf:auto:6.5,gguf:auto:4.5 --json --out $OUT/bench-context-smollm2-wave11.json > /dev/null
BYTEDIET_KERNELS=avx2 $B --parts context --contexts 2048,8192 --peers llama.cpp --formats gguf:int8,gguf:q8_0 \
   --json --out $OUT/bench-context-smollm2-avx2-wave11.json > /dev/null
.venv/bin/python bench/kv_attention_time.py --contexts 8192 --native --json \
   --codecs fp32 bf16 int8 fp8 q8_0 q5_0 q4_1 q4_0 rot-int8 rot-q8_0 turboquant3.5 \
   > $OUT/kv-attention-8k-wave11.json
