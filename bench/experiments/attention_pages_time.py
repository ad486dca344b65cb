"""Native paged decode attention alone over a model's worth of layers: ms per step (Recording 10's probe).

B sequences each decode one token at context CTX over a model's layers of separate (cold) pages — SmolLM2's shapes
(30 layers, 9 query heads, 3 KV heads, head dim 64) or, with ``--shape gemma3``, Gemma-3-270M's (18 layers, 4 query
heads, 1 KV head, head dim 256); blocks of 16 — every layer one ``ops.attention_over_pages`` call; the median of 9
steps. ``BYTEDIET_KERNELS=avx2`` times the portable variant. Page types: fp32, bf16, fp16 (torch tensors) or any
the native attention writes (int8, fp8, q8_0, …). ``--shuffle`` scatters the blocks (the prefetch goes through the
block table).

    .venv/bin/python bench/experiments/attention_pages_time.py 16 2057 fp32
    .venv/bin/python bench/experiments/attention_pages_time.py 1 8192 int8
    .venv/bin/python bench/experiments/attention_pages_time.py 16 2057 bf16 --shape gemma3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bytediet.kernels import ops

SHAPES = {"smollm2": (9, 3, 64, 30), "gemma3": (4, 1, 256, 18)}  # query heads, KV heads, head dim, layers
BLOCK = 16
FLOAT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("batch", type=int)
    p.add_argument("context", type=int)
    p.add_argument("kv_dtype")
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    a = p.parse_args()
    HEADS, KV_HEADS, HEAD_DIM, LAYERS = SHAPES[a.shape]
    torch.manual_seed(0)
    blocks = -(-a.context // BLOCK)
    order = torch.randperm(a.batch * blocks) if a.shuffle else torch.arange(a.batch * blocks)
    tables = order.view(a.batch, blocks)
    slots = a.batch * blocks * BLOCK

    def pages():
        x = torch.randn(slots, KV_HEADS, HEAD_DIM)
        return (x.to(FLOAT[a.kv_dtype]), None) if a.kv_dtype in FLOAT else ops.write_kv_rows(a.kv_dtype, x)

    layers = [(pages(), pages()) for _ in range(LAYERS)]
    q = torch.randn(a.batch, HEADS, HEAD_DIM)
    positions, rows = torch.full((a.batch,), a.context - 1), torch.arange(a.batch)

    def step():
        for (k, ks), (v, vs) in layers:
            ops.attention_over_pages(q, positions, rows, tables, BLOCK, HEAD_DIM**-0.5, None, a.kv_dtype, k, v, ks, vs)

    step()
    times = []
    for _ in range(9):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    page_bytes = sum(t.numel() * t.element_size() for (k, _), (v, _) in layers for t in (k, v))
    kv_bytes = page_bytes * a.context / (blocks * BLOCK)  # the positions read, not the block tails
    m = statistics.median(times)
    print(
        f"{a.shape} {a.kv_dtype} batch {a.batch} context {a.context}: {m * 1e3:.2f} ms a step "
        f"(min {min(times) * 1e3:.2f}), "
        f"{kv_bytes / 1e9:.2f} GB of pages → {kv_bytes / m / 1e9:.1f} GB/s"
    )


if __name__ == "__main__":
    main()
