"""Mixture of experts on this CPU: token-grouped experts against the two obvious alternatives, and the
engine's decode step against the roofline of the *active* weights.

1. One MoE block (random weights, Mixtral-shaped: E experts, top-k) on T tokens, three ways:
   ``grouped`` (bytediet: one call per touched expert on all its tokens), ``per-token`` (a Python loop
   over tokens and their k experts: each expert read once per token), ``all-experts`` (every expert on
   every token, weights masked: each expert read once, E·T rows of work). Median time and the expert
   weight bytes each reads.
2. A random MoE model through the engine (``LLM``): decode tok/s at batch 1, the bytes one decode step
   reads (attention + router + k experts, from the model's own tensors) against all weights, achieved
   GB/s, and the roofline analyzer's prediction for the same config on this machine's measured ceilings.

    PYTHONPATH=src .venv/bin/python bench/moe_decode.py [--hidden 1024] [--experts 8] [--top-k 2] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bytediet.config import ModelConfig
from bytediet.engine.llm import LLM
from bytediet.engine.params import SamplingParams
from bytediet.models.loader import build_model
from bytediet.models.moe import SparseMoE
from bytediet.models.quantize import QuantizeConfig, quantize
from bytediet.perf.measure import this_machine
from bytediet.perf.roofline import analyze
from bytediet.quant import build_format, get_weight_format


def random_model(config: ModelConfig, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    model = build_model(config)
    fp32 = get_weight_format("fp32")
    for _, lin in model.linear_layers():
        lin.set_weight(torch.randn(lin.out_features, lin.in_features, generator=g) * lin.in_features**-0.5, fp32)
    for name, p in model.named_parameters():
        if p.device.type == "meta" or "embed" in name:
            continue
        p.data = (
            (1.0 + 0.1 * torch.randn(p.shape, generator=g)) if "norm" in name else torch.randn(p.shape, generator=g)
        )
    model.model.embed_tokens.weight = torch.nn.Parameter(
        torch.randn(config.vocab_size, config.hidden_size, generator=g), requires_grad=False
    )
    return model


def per_token(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    weights, ids = block.route(x)
    rows = [sum(w * block.experts[int(e)](x[t : t + 1])[0] for w, e in zip(weights[t], ids[t])) for t in range(len(x))]
    return torch.stack(rows)


def all_experts(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    weights, ids = block.route(x)
    dense = torch.zeros(len(x), len(block.experts)).scatter(1, ids, weights)  # (T, E), zero where not routed
    return sum(dense[:, e : e + 1] * expert(x) for e, expert in enumerate(block.experts))


def median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def block_rows(config: ModelConfig, tokens: list[int], repeats: int) -> list[dict]:
    model = random_model(config)
    block = model.model.layers[0].mlp
    expert_bytes = sum(
        lin.packed["weight"].numel() * 4
        for lin in (block.experts[0].gate_proj, block.experts[0].up_proj, block.experts[0].down_proj)
    )
    rows = []
    for t in tokens:
        x = torch.randn(t, config.hidden_size, generator=torch.Generator().manual_seed(t))
        touched = int(block.route(x)[1].unique().numel())
        torch.testing.assert_close(block(x), all_experts(block, x), atol=1e-4, rtol=1e-4)
        methods = (
            ("grouped", block, touched),
            ("per-token", lambda v: per_token(block, v), t * config.num_experts_per_tok),
            ("all-experts", lambda v: all_experts(block, v), config.num_experts),
        )
        for name, fn, reads in methods:
            s = median_s(lambda: fn(x), repeats)
            rows.append(
                {
                    "tokens": t,
                    "method": name,
                    "ms": s * 1e3,
                    "expert_weight_mb": reads * expert_bytes / 1e6,
                    "gb_per_s": reads * expert_bytes / s / 1e9,
                }
            )
    return rows


def decode_rows(config: ModelConfig, formats: list[str], tokens: int) -> list[dict]:
    hw = this_machine(measure_if_missing=True, threads=torch.get_num_threads())
    rows = []
    for fmt in formats:
        model = random_model(config)
        if fmt != "fp32":
            quantize(model, QuantizeConfig(format=fmt, output_policy="same"))
        total, active = model.weight_bytes(), model.decode_weight_bytes()
        llm = LLM("random-moe", loaded=(model, None), kv_cache_memory="64MiB")
        out = llm.generate([list(range(1, 17))], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))[0]
        decode_s = out.finish_time - out.first_token_time
        tok_s = (tokens - 1) / decode_s
        predicted = analyze(config, hw, weights=build_format(fmt), kv=32.0, batch=1, context=16 + tokens // 2)
        rows.append(
            {
                "weights": fmt,
                "decode_tok_s": tok_s,
                "total_weight_mb": total / 1e6,
                "active_bytes_per_step_mb": active / 1e6,
                "achieved_gb_s": active * tok_s / 1e9,
                "machine_read_gb_s": hw.memory_bandwidth / 1e9,
                "roofline_decode_tok_s": predicted.decode_tokens_per_s,
                "roofline_decode_mb": predicted.decode.bytes / 1e6,
            }
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--formats", default="fp32,int8")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = ModelConfig(
        "mixtral",
        vocab_size=4096,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=args.hidden // 128,
        num_kv_heads=max(1, args.hidden // 512),
        head_dim=128,
        tie_word_embeddings=False,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_gating="topk-softmax",
        norm_topk_prob=True,
        name=f"random-moe-{args.experts}x{args.top_k}",
    )
    result = {
        "config": config.to_dict()
        | {"num_parameters": config.num_parameters, "num_active_parameters": config.num_active_parameters},
        "threads": torch.get_num_threads(),
        "block": block_rows(config, [int(t) for t in args.tokens.split(",")], args.repeats),
        "decode": decode_rows(config, args.formats.split(","), args.decode_tokens),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{config.name}: {config.num_parameters / 1e6:.1f} M parameters, "
        f"{config.num_active_parameters / 1e6:.1f} M active"
    )
    print(f"{'T':>4} {'method':>12} {'ms':>9} {'expert MB read':>15} {'GB/s':>7}")
    for r in result["block"]:
        print(
            f"{r['tokens']:>4} {r['method']:>12} {r['ms']:>9.2f} {r['expert_weight_mb']:>15.1f} {r['gb_per_s']:>7.2f}"
        )
    for r in result["decode"]:
        print(
            f"decode {r['weights']}: {r['decode_tok_s']:.1f} tok/s; reads {r['active_bytes_per_step_mb']:.1f} of "
            f"{r['total_weight_mb']:.1f} MB per step = {r['achieved_gb_s']:.2f} GB/s "
            f"(machine {r['machine_read_gb_s']:.1f} GB/s; "
            f"roofline {r['roofline_decode_tok_s']:.1f} tok/s, {r['roofline_decode_mb']:.1f} MB)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
