"""Perplexity change per weight format on real text (Austen), for SmolLM2-135M and Gemma-3-270M.

Every linear layer (lm_head included unless --keep-lm-head) is re-quantized from the model's float
weights, then the first ``--tokens`` tokens of a fixed evaluation window of Pride and Prejudice are
scored. SmolLM2's GGUF is already Q4_1 (asymmetric, blocks of 32): re-quantizing to int4-g32 is
nearly lossless, so the int4 comparisons use g64/g128 and symmetric grids (576 input channels rule out g128).

    .venv/bin/python bench/quant_ppl.py [--models default gemma3-270m] [--formats int8 ...] [--json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from bytediet.errors import ConfigError
from bytediet.eval.corpus import load_corpus, make_windows
from bytediet.models.loader import load_model
from bytediet.quant.apply import QuantizeConfig, quantize

FORMATS = ["int8", "int8-w8a8", "fp8", "int4-g128", "int4-g128-sym", "int4-g64", "int4-g64-sym", "int4-g32",
           "mxfp4", "nvfp4"]


def perplexity(model, ids: torch.Tensor) -> float:
    logits = model.score(ids)[:-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="mean")
    return math.exp(nll.item())


def run_model(spec: str, formats: list[str], n_tokens: int, keep_lm_head: bool) -> dict:
    model, tokenizer = load_model(spec, dtype=torch.float32)
    ids = torch.tensor(tokenizer.encode(load_corpus("prideprejudice")), dtype=torch.long)
    win = make_windows(ids, n_tokens, count=1, split="eval", seed=0)[0]
    window = win.ids
    original = {name: (layer.format, layer.packed) for name, layer in model.linear_layers()}
    base = perplexity(model, window)
    rows = [{"format": "source (GGUF dequantized, fp32)", "ppl": base, "delta_pct": 0.0, "bytes": None}]
    for fmt in formats:
        t0 = time.perf_counter()
        try:
            summary = quantize(model, QuantizeConfig(format=fmt, skip=("lm_head",) if keep_lm_head else ()))
        except ConfigError as exc:  # e.g. SmolLM2's 576 input channels are not a multiple of 128
            rows.append({"format": fmt, "ppl": None, "delta_pct": None, "bytes": None, "error": str(exc)})
            continue
        ppl = perplexity(model, window)
        rows.append({"format": fmt, "ppl": ppl, "delta_pct": 100 * (ppl / base - 1), "bytes": summary.bytes_after,
                     "seconds": round(time.perf_counter() - t0, 1)})
        for name, layer in model.linear_layers():  # back to the source weights for the next format
            layer.set_packed(*original[name])
    return {"model": spec, "tokens": int(window.numel()), "window_start": win.start, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["default", "gemma3-270m"])
    p.add_argument("--formats", nargs="+", default=FORMATS)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--keep-lm-head", action="store_true", help="leave lm_head (tied to the embedding) unquantized")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    results = [run_model(m, args.formats, args.tokens, args.keep_lm_head) for m in args.models]
    if args.json:
        print(json.dumps({"results": results}))
        return 0
    for r in results:
        print(f"\n{r['model']}: perplexity on {r['tokens']} tokens of Pride and Prejudice (eval window, seed 0)")
        print(f"  {'format':34s} {'ppl':>9s} {'Δ%':>8s} {'linear MB':>10s}")
        for row in r["rows"]:
            if row["ppl"] is None:
                print(f"  {row['format']:34s} n/a: {row['error'].split(': ', 1)[-1][:70]}")
                continue
            mb = f"{row['bytes'] / 2**20:10.1f}" if row["bytes"] else " " * 10
            print(f"  {row['format']:34s} {row['ppl']:9.3f} {row['delta_pct']:+8.2f} {mb}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
