"""Attention time of one decode step per KV codec, at several context lengths, against plain SDPA.

For each codec a layer cache holds ``context`` tokens of one sequence (K/V drawn from a seeded normal,
so this measures time, not accuracy), then one new token is written and its query attends over the
paged cache — exactly what a decode step does in every layer. Reported: the median over ``--repeats``
of (write + attend) per layer, that × the model's layer count (the attention share of a decode step),
and the same for ``torch.nn.functional.scaled_dot_product_attention`` on contiguous fp32 and bf16
tensors (no paging, no compression: the floor a fused kernel would approach). Shapes are the model's
(default SmolLM2: 9 query heads, 3 KV heads, head dim 64, 30 layers).

    .venv/bin/python bench/kv_attention_time.py [--model default] [--contexts 1024 4096 8192]
        [--codecs fp32 bf16 int8 fp8 kivi4 kivi2 qjl polarquant turboquant3.5 turboquant2.5] [--json]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

CODECS = ["fp32", "bf16", "int8", "fp8", "kivi4", "kivi2", "qjl", "polarquant", "turboquant4", "turboquant3.5",
          "turboquant2.5", "turboquant_prod3.5"]
BLOCK_SIZE = 32


def decode_meta(context: int, block_size: int):
    """AttentionMetadata of one sequence decoding its token number ``context`` (0-based) into block-ordered slots."""
    from bytediet.kvcache.base import AttentionMetadata

    blocks = math.ceil((context + 1) / block_size)
    return AttentionMetadata(positions=torch.tensor([context]), slot_mapping=torch.tensor([context]),
                             query_start_loc=torch.tensor([0, 1]), context_lens=torch.tensor([context + 1]),
                             block_tables=torch.arange(blocks)[None], block_size=block_size,
                             query_lens_list=[1], context_lens_list=[context + 1], seq_ids=[0])


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_codec(spec: str, context: int, heads: int, kv_heads: int, head_dim: int, repeats: int) -> float:
    from bytediet.kvcache import get_kv_codec
    from bytediet.kvcache.base import AttentionMetadata

    gen = torch.Generator().manual_seed(0)
    codec = get_kv_codec(spec, torch.float32)
    blocks = math.ceil((context + 1) / BLOCK_SIZE)
    cache = codec.create_cache(0, blocks, BLOCK_SIZE, kv_heads, head_dim, torch.float32, "cpu")
    k = torch.randn(context, kv_heads, head_dim, generator=gen)
    v = torch.randn(context, kv_heads, head_dim, generator=gen)
    prefill = AttentionMetadata.for_single_sequence(context, BLOCK_SIZE, "cpu")
    prefill.seq_ids = [0]
    cache.write(k, v, prefill.slot_mapping)
    meta = decode_meta(context, BLOCK_SIZE)
    q = torch.randn(1, heads, head_dim, generator=gen)
    k1, v1 = torch.randn(1, kv_heads, head_dim, generator=gen), torch.randn(1, kv_heads, head_dim, generator=gen)
    scale = head_dim ** -0.5

    def step():
        cache.write(k1, v1, meta.slot_mapping)  # the same slot every time: the context stays `context + 1`
        cache.attend(q, meta, scale)

    return median_time(step, repeats)


def time_sdpa(dtype: torch.dtype, context: int, heads: int, kv_heads: int, head_dim: int, repeats: int) -> float:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, 1, head_dim, generator=gen).to(dtype)
    k = torch.randn(1, kv_heads, context + 1, head_dim, generator=gen).to(dtype)
    v = torch.randn(1, kv_heads, context + 1, head_dim, generator=gen).to(dtype)
    return median_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True), repeats)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="takes head counts, head dim and layer count from it")
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096, 8192])
    p.add_argument("--codecs", nargs="+", default=CODECS)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from bytediet.models.loader import load_config

    torch.set_num_threads(args.threads)
    c = load_config(args.model)
    dims = (c.num_heads, c.num_kv_heads, c.head_dim)
    rows = []
    for context in args.contexts:
        for name, fn in [(f"sdpa-{d}", lambda n, d=d: time_sdpa(getattr(torch, d), n, *dims, args.repeats))
                         for d in ("float32", "bfloat16")] + \
                        [(s, lambda n, s=s: time_codec(s, n, *dims, args.repeats)) for s in args.codecs]:
            try:
                per_layer = fn(context)
            except Exception as exc:  # a codec that cannot take these shapes is a row, not a crash
                rows.append({"codec": name, "context": context, "error": f"{type(exc).__name__}: {exc}"})
                continue
            rows.append({"codec": name, "context": context, "per_layer_ms": 1e3 * per_layer,
                         "per_step_ms": 1e3 * per_layer * c.num_layers})
            print(f"  {context:6d} {name:20s} {1e3 * per_layer:8.3f} ms/layer", file=sys.stderr, flush=True)
    for r in rows:
        base = next((b for b in rows if b["context"] == r["context"] and b["codec"] == "sdpa-float32"), None)
        if "per_layer_ms" in r and base:
            r["vs_sdpa_fp32"] = r["per_layer_ms"] / base["per_layer_ms"]
    out = {"model": args.model, "heads": dims[0], "kv_heads": dims[1], "head_dim": dims[2], "layers": c.num_layers,
           "threads": args.threads, "block_size": BLOCK_SIZE, "rows": rows}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'context':>8s} {'codec':20s} {'ms/layer':>9s} {'ms/step':>9s} {'vs SDPA fp32':>12s}")
    for r in rows:
        if "error" in r:
            print(f"{r['context']:8d} {r['codec']:20s} {r['error'][:60]}")
        else:
            print(f"{r['context']:8d} {r['codec']:20s} {r['per_layer_ms']:9.3f} {r['per_step_ms']:9.2f} "
                  f"{r.get('vs_sdpa_fp32', float('nan')):12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
