"""Attention time of one decode step per KV codec, at several context lengths, against plain SDPA.

For each codec a layer cache holds ``context`` tokens of one sequence (K/V drawn from a seeded normal,
so this measures time, not accuracy), then one new token is written and its query attends over the
paged cache — exactly what a decode step does in every layer. Reported: the median over ``--repeats``
of (write + attend) per layer, that × the model's layer count (the attention share of a decode step),
and the same for ``torch.nn.functional.scaled_dot_product_attention`` on contiguous fp32 and bf16
tensors (no paging, no compression: the floor a fused kernel would approach). Shapes are the model's
(default SmolLM2: 9 query heads, 3 KV heads, head dim 64, 30 layers).

The ``<codec>`` rows are the module path's write + attend; its attention is the native kernel over the stored
codes wherever ``LayerKVCache.native_pages`` describes them — every codec listed by default (KIVI, QJL, PolarQuant,
TurboQuant and turboquant_prod, hf2/hf4 too), the codec's own read elsewhere (no native library).

``--native``: also time, for every codec the native decode step reads (fp32, bf16, fp16, int8, fp8, q8_0 … q4_0,
turboquant), that step's write + attention (``native-<codec>`` rows; the others are error rows: the step does not
write their codes): a one-layer ``DecoderSpec`` with the model's head
shapes and a 32-wide hidden state, so its linear layers cost microseconds and the call is the paged attention
on the stored codes. Every row gives the KV bytes a step reads at that context (``kv_mb_per_step``, all layers)
and the rate it reads them at.

    .venv/bin/python bench/kv_attention_time.py [--model default] [--contexts 1024 4096 8192]
        [--codecs fp32 bf16 int8 fp8 kivi4 kivi2 qjl polarquant turboquant3.5 turboquant2.5] [--native] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

CODECS = [
    "fp32",
    "bf16",
    "int8",
    "fp8",
    "kivi4",
    "kivi2",
    "qjl",
    "polarquant",
    "turboquant4",
    "turboquant3.5",
    "turboquant2.5",
    "turboquant_prod3.5",
]
BLOCK_SIZE = 32  # or the codec's own minimum block where larger (the HF anchors' 128-token window)


def block_size(spec: str) -> int:
    from bytediet.kvcache.base import default_block_size

    return max(BLOCK_SIZE, default_block_size(spec))


def decode_meta(context: int, block_size: int):
    """AttentionMetadata of one sequence decoding its token number ``context`` (0-based) into block-ordered slots."""
    from bytediet.kvcache.base import AttentionMetadata

    blocks = math.ceil((context + 1) / block_size)
    return AttentionMetadata(
        positions=torch.tensor([context]),
        slot_mapping=torch.tensor([context]),
        query_start_loc=torch.tensor([0, 1]),
        context_lens=torch.tensor([context + 1]),
        block_tables=torch.arange(blocks)[None],
        block_size=block_size,
        query_lens_list=[1],
        context_lens_list=[context + 1],
        seq_ids=[0],
    )


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
    bs = block_size(spec)
    codec = get_kv_codec(spec, torch.float32)
    blocks = math.ceil((context + 1) / bs)
    cache = codec.create_cache(0, blocks, bs, kv_heads, head_dim, torch.float32, "cpu")
    k = torch.randn(context, kv_heads, head_dim, generator=gen)
    v = torch.randn(context, kv_heads, head_dim, generator=gen)
    prefill = AttentionMetadata.for_single_sequence(context, bs, "cpu")
    prefill.seq_ids = [0]
    cache.write(k, v, prefill.slot_mapping)
    meta = decode_meta(context, bs)
    q = torch.randn(1, heads, head_dim, generator=gen)
    k1, v1 = torch.randn(1, kv_heads, head_dim, generator=gen), torch.randn(1, kv_heads, head_dim, generator=gen)
    scale = head_dim**-0.5

    def step():
        cache.write(k1, v1, meta.slot_mapping)  # the same slot every time: the context stays `context + 1`
        cache.attend(q, meta, scale)

    return median_time(step, repeats)


def _native_layer(cache, heads: int, kv_heads: int, head_dim: int, gen):
    """A one-layer DecoderSpec over ``cache``'s pages with tiny linear layers (hidden 32), or None when the native
    step cannot read this codec."""
    from gguf import GGMLQuantizationType

    from bytediet.kernels.decoder_spec import DecoderSpec, LayerSpec, LinearSpec
    from bytediet.kernels.ggml_codecs import ENCODERS
    from bytediet.models.native_decode import _pages

    pages = _pages(cache)
    if pages is None:
        return None
    hidden = inter = 32

    def lin(n, k):
        blocks = ENCODERS[GGMLQuantizationType.Q8_0](torch.randn(n * k // 32, 32, generator=gen) * 0.1)
        return LinearSpec(blocks.reshape(n, -1), int(GGMLQuantizationType.Q8_0), n, k)

    layer = LayerSpec(
        attn_norm=torch.ones(hidden),
        post_attn_norm=torch.ones(hidden),
        inv_freq=1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)),
        q=lin(heads * head_dim, hidden),
        k=lin(kv_heads * head_dim, hidden),
        v=lin(kv_heads * head_dim, hidden),
        o=lin(hidden, heads * head_dim),
        gate=lin(inter, hidden),
        up=lin(inter, hidden),
        down=lin(hidden, inter),
        **pages,
    )
    return DecoderSpec(
        [layer],
        hidden,
        inter,
        heads,
        kv_heads,
        head_dim,
        1e-6,
        head_dim**-0.5,
        gelu=False,
        sandwich=False,
        activations="f32",
    )


def time_native(spec: str, context: int, heads: int, kv_heads: int, head_dim: int, repeats: int) -> float:
    """One native decode step of one layer over ``context`` tokens of ``spec`` pages: write + attention."""
    from bytediet.kernels import ops
    from bytediet.kvcache import get_kv_codec
    from bytediet.kvcache.base import AttentionMetadata

    gen = torch.Generator().manual_seed(0)
    bs = block_size(spec)
    codec = get_kv_codec(spec, torch.float32)
    blocks = math.ceil((context + 1) / bs)
    cache = codec.create_cache(0, blocks, bs, kv_heads, head_dim, torch.float32, "cpu")
    prefill = AttentionMetadata.for_single_sequence(context, bs, "cpu")
    prefill.seq_ids = [0]
    cache.write(
        torch.randn(context, kv_heads, head_dim, generator=gen),
        torch.randn(context, kv_heads, head_dim, generator=gen),
        prefill.slot_mapping,
    )
    layer = _native_layer(cache, heads, kv_heads, head_dim, gen)
    if layer is None:
        raise ValueError(f"the native decode step does not read {spec} pages")
    meta = decode_meta(context, bs)
    x = torch.randn(1, layer.hidden, generator=gen)
    return median_time(
        lambda: ops.decode_step(layer, x, meta.positions, meta.slot_mapping, meta.block_tables, bs), repeats
    )


def time_sdpa(dtype: torch.dtype, context: int, heads: int, kv_heads: int, head_dim: int, repeats: int) -> float:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, 1, head_dim, generator=gen).to(dtype)
    k = torch.randn(1, kv_heads, context + 1, head_dim, generator=gen).to(dtype)
    v = torch.randn(1, kv_heads, context + 1, head_dim, generator=gen).to(dtype)
    return median_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True), repeats)


def kv_bytes_per_layer(name: str, context: int, dims: tuple[int, int, int]) -> float:
    """The K and V bytes one layer's attention reads at ``context`` (+ the new token), all-in per the codec."""
    from bytediet.kvcache import get_kv_codec

    _, kv_heads, head_dim = dims
    if name.startswith("sdpa-"):
        per_token = 2 * kv_heads * head_dim * (4 if name == "sdpa-float32" else 2)
    else:
        per_token = get_kv_codec(name.removeprefix("native-"), torch.float32).bytes_per_token(kv_heads, head_dim)
    return per_token * (context + 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="takes head counts, head dim and layer count from it")
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096, 8192])
    p.add_argument("--codecs", nargs="+", default=CODECS)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--native", action="store_true", help="also time the native decode step's attention per codec")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from bytediet.models.loader import load_config

    torch.set_num_threads(args.threads)
    if args.native:
        from bytediet.kernels import ops

        ops.native_library().set_num_threads(args.threads)
    c = load_config(args.model)
    dims = (c.num_heads, c.num_kv_heads, c.head_dim)
    rows = []
    for context in args.contexts:
        for name, fn in (
            [
                (f"sdpa-{d}", lambda n, d=d: time_sdpa(getattr(torch, d), n, *dims, args.repeats))
                for d in ("float32", "bfloat16")
            ]
            + [(s, lambda n, s=s: time_codec(s, n, *dims, args.repeats)) for s in args.codecs]
            + [
                (f"native-{s}", lambda n, s=s: time_native(s, n, *dims, args.repeats))
                for s in (args.codecs if args.native else [])
            ]
        ):
            try:
                per_layer = fn(context)
            except Exception as exc:  # a codec that cannot take these shapes is a row, not a crash
                rows.append({"codec": name, "context": context, "error": f"{type(exc).__name__}: {exc}"})
                continue
            kv_bytes = kv_bytes_per_layer(name, context, dims)
            rows.append(
                {
                    "codec": name,
                    "context": context,
                    "per_layer_ms": 1e3 * per_layer,
                    "per_step_ms": 1e3 * per_layer * c.num_layers,
                    "kv_mb_per_step": kv_bytes * c.num_layers / 1e6,
                    "read_gb_s": kv_bytes / per_layer / 1e9,
                }
            )
            print(f"  {context:6d} {name:20s} {1e3 * per_layer:8.3f} ms/layer", file=sys.stderr, flush=True)
    for r in rows:
        base = next((b for b in rows if b["context"] == r["context"] and b["codec"] == "sdpa-float32"), None)
        if "per_layer_ms" in r and base:
            r["vs_sdpa_fp32"] = r["per_layer_ms"] / base["per_layer_ms"]
    out = {
        "model": args.model,
        "heads": dims[0],
        "kv_heads": dims[1],
        "head_dim": dims[2],
        "layers": c.num_layers,
        "threads": args.threads,
        "block_size": BLOCK_SIZE,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"{'context':>8s} {'codec':20s} {'ms/layer':>9s} {'ms/step':>9s} "
        f"{'vs SDPA fp32':>12s} {'MB/step':>8s} {'GB/s':>6s}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['context']:8d} {r['codec']:20s} {r['error'][:60]}")
        else:
            print(
                f"{r['context']:8d} {r['codec']:20s} {r['per_layer_ms']:9.3f} {r['per_step_ms']:9.2f} "
                f"{r.get('vs_sdpa_fp32', float('nan')):12.2f} {r['kv_mb_per_step']:8.1f} {r['read_gb_s']:6.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
