#!/usr/bin/env bash
# The session-10 recordings of bench/RESULTS.md ("Recording 10", Zen 5 VM with AVX-512 VNNI/BF16): the AVX-512
# attention passes (each KV row read once for every query head that shares it, keys in address order, rows
# prefetched a few positions ahead through the block table) and native attention on the codes of QJL,
# PolarQuant, turboquant_prod and HF's QuantizedCache. The batch-16 roofline rows (73- and 2057-token contexts),
# context scaling at 2k/4k/8k with fp32, int8 and turboquant3.5 KV against llama.cpp, and every codec's
# write + attention time per layer at 8k (module path and native step) for bench/KV_RESULTS.md.
# Needs llama-cpp-python in .venv (pip install -c constraints.txt llama-cpp-python). About 15 minutes on 2 cores;
# run it on a quiet machine (each JSON file records the load average before and after).
set -euo pipefail
cd "$(dirname "$0")/../.."
B=".venv/bin/bytediet bench --threads 2"
OUT=bench/results
$B --parts roofline --roofline-batches 1,16 --peers none --json --out $OUT/bench-roofline-wave10.json > /dev/null
$B --parts roofline --roofline-batches 16 --roofline-context 2048 --peers none \
   --json --out $OUT/bench-roofline-2k-wave10.json > /dev/null
$B --parts context --contexts 2048,4096,8192 --peers llama.cpp --formats gguf:int8,gguf:turboquant3.5 \
   --json --out $OUT/bench-context-smollm2-wave10.json > /dev/null
.venv/bin/python bench/kv_attention_time.py --contexts 8192 --native --json \
   --codecs fp32 bf16 int8 fp8 q8_0 q4_0 rot-int8 rot-q8_0 kivi4 kivi2 hf4 hf2 qjl polarquant turboquant3.5 \
            turboquant_prod3.5 \
   > $OUT/kv-attention-8k-wave10.json
