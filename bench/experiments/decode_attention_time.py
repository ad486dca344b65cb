"""Time the native decode step of a random decoder at a long context: the attention kernel in isolation.

A ``layers``-layer decoder with tiny linear layers (hidden 64) and SmolLM2's head shapes (9 query heads, 3 KV
heads, head dim 64) over ``context`` tokens of random pages of one page type, so the step is its attention.
Prints the per-layer time (lower quartile of 30 calls) and the KV read rate.

    .venv/bin/python bench/experiments/decode_attention_time.py CONTEXT [fp32|bf16|fp16|int8|fp8]
    env: NT (kernel threads, default 1), LAYERS (default 4: 50 MB of fp32 pages at 8k, beyond the L3),
         CPU_TIME=1 (time.thread_time of the caller: load-robust, meaningful with NT=1 only)
"""

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bytediet.kernels import ops
from tests.kernels.test_ops_decode_step import BLOCK, random_spec

context = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
kv = sys.argv[2] if len(sys.argv) > 2 else "fp32"
ops.native_library().set_num_threads(int(os.environ.get("NT", "1")))
clock = time.thread_time if os.environ.get("CPU_TIME") else time.perf_counter
layers = int(os.environ.get("LAYERS", "4"))
gen = torch.Generator().manual_seed(0)
slots = context + 64
spec = random_spec(gen, heads=9, kv_heads=3, head_dim=64, hidden=64, inter=64, layers=layers, slots=slots, k_dtype=kv)
tables = torch.arange(slots // BLOCK).long()[None]
positions = torch.tensor([context - 1])
x = torch.randn(1, 64)
for _ in range(3):
    ops.decode_step(spec, x.clone(), positions, positions.clone(), tables, BLOCK)
times = []
for _ in range(30):
    t = clock()
    ops.decode_step(spec, x.clone(), positions, positions.clone(), tables, BLOCK)
    times.append(clock() - t)
times.sort()
per_layer = times[len(times) // 4] / layers
kv_bytes = context * 3 * 64 * 2 * {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "fp8": 1}[kv]
print(
    f"context {context}, {kv} pages: {per_layer * 1e3:.3f} ms per layer (min {times[0] / layers * 1e3:.3f}); "
    f"KV {kv_bytes / 1e6:.1f} MB per layer → {kv_bytes / per_layer / 1e9:.1f} GB/s"
)
