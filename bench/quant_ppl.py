"""Perplexity change per weight format on real text (Austen), for SmolLM2-135M and Gemma-3-270M.

Every linear layer is re-quantized from the model's float weights under the default output policy
(lm_head — the tied embedding — kept at int8 below 8 bits, left as is otherwise; ``--output-policy same``
quantizes it too, ``--keep-lm-head`` leaves it unquantized), then ``--windows`` evaluation windows of
``--tokens`` tokens of ``--corpus`` are scored (BOS first). SmolLM2's GGUF is already Q4_1 (asymmetric,
blocks of 32): re-quantizing to int4-g32 is nearly lossless, so the int4 comparisons use g64/g128 and
symmetric grids (576 input channels rule out g128).

A format may name a calibration method after "+": ``int4-g64+awq``, ``int4-g64+gptq``,
``int8-w8a8+smoothquant``. Calibration windows come from the calibration split of the same corpus
(``--calib-samples`` × ``--calib-len``), disjoint from the evaluation windows.

    .venv/bin/python bench/quant_ppl.py [--models default gemma3-270m] [--formats int8 int4-g64+gptq ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from bytediet.calibrate import CalibrationConfig, calibrate_and_quantize
from bytediet.errors import ConfigError
from bytediet.eval.corpus import calibration_windows, load_corpus, make_windows
from bytediet.models.loader import load_model
from bytediet.models.quantize import QuantizeConfig, quantize
from bytediet.progress import rich_progress

FORMATS = [
    "int8",
    "int8-w8a8",
    "fp8",
    "int4-g128",
    "int4-g128-sym",
    "int4-g64",
    "int4-g64-sym",
    "int4-g32",
    "mxfp4",
    "nvfp4",
]


def perplexity(model, windows: list[torch.Tensor], bos: list[int]) -> float:
    """exp(mean next-token NLL) over the windows' tokens (BOS, when the model has one, is context only)."""
    total, count = 0.0, 0
    prefix = torch.tensor(bos, dtype=torch.long)
    for ids in windows:
        seq = torch.cat([prefix, ids])
        logits = model.score(seq)[len(bos) : -1].float()
        total += torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum").item()
        count += len(ids) - 1
    return math.exp(total / count)


def run_model(
    spec: str,
    formats: list[str],
    n_tokens: int,
    keep_lm_head: bool,
    corpus: str = "prideprejudice",
    n_windows: int = 1,
    output_policy: str = "protect",
    calib: CalibrationConfig | None = None,
    method_options: dict | None = None,
) -> dict:
    model, tokenizer = load_model(spec, dtype=torch.float32)
    ids = torch.tensor(tokenizer.encode(load_corpus(corpus), add_special_tokens=False), dtype=torch.long)
    wins = make_windows(ids, n_tokens, count=n_windows, split="eval", seed=0)
    windows = [w.ids for w in wins]
    bos = tokenizer.encode("", add_special_tokens=True)
    original = {name: (layer.format, layer.packed) for name, layer in model.linear_layers()}
    norms = {name: p.data.clone() for name, p in model.named_parameters() if "norm" in name}  # folded by AWQ / SQ
    base = perplexity(model, windows, bos)
    rows = [{"format": "source (GGUF dequantized, fp32)", "ppl": base, "delta_pct": 0.0, "bytes": None}]
    calib = calib or CalibrationConfig(corpus=corpus)
    calib_windows = None
    for entry in formats:
        fmt, _, method = entry.partition("+")
        t0 = time.perf_counter()
        config = QuantizeConfig(format=fmt, skip=("lm_head",) if keep_lm_head else (), output_policy=output_policy)
        try:
            if method:
                if calib_windows is None:
                    calib_windows = calibration_windows(tokenizer, calib)
                summary = calibrate_and_quantize(
                    model, config, method, calib_windows, calib, rich_progress, **(method_options or {}).get(method, {})
                )
            else:
                summary = quantize(model, config)
        except ConfigError as exc:  # e.g. SmolLM2's 576 input channels are not a multiple of 128
            rows.append({"format": entry, "ppl": None, "delta_pct": None, "bytes": None, "error": str(exc)})
            continue
        ppl = perplexity(model, windows, bos)
        rows.append(
            {
                "format": entry,
                "ppl": ppl,
                "delta_pct": 100 * (ppl / base - 1),
                "bytes": summary.bytes_after,
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
        print(f"  [{spec}] {entry}: ppl {ppl:.4f} ({100 * (ppl / base - 1):+.2f}%)", file=sys.stderr, flush=True)
        for name, layer in model.linear_layers():  # back to the source weights for the next format
            layer.set_packed(*original[name])
        for name, p in model.named_parameters():
            if name in norms:
                p.data = norms[name].clone()
    return {
        "model": spec,
        "tokens": int(sum(w.numel() for w in windows)),
        "windows": len(windows),
        "window_starts": [w.start for w in wins],
        "corpus": corpus,
        "output_policy": output_policy,
        "calibration": calib.to_dict(),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["default", "gemma3-270m"])
    p.add_argument("--formats", nargs="+", default=FORMATS)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--keep-lm-head", action="store_true", help="leave lm_head (tied to the embedding) unquantized")
    p.add_argument(
        "--output-policy",
        choices=["protect", "same"],
        default="protect",
        help="protect: lm_head at int8 below 8 bits (default); same: quantize it like every layer",
    )
    p.add_argument("--corpus", default="prideprejudice", help="evaluation and calibration corpus (e.g. austen)")
    p.add_argument("--windows", type=int, default=1, help="evaluation windows of --tokens tokens")
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--calib-len", type=int, default=512)
    p.add_argument("--awq-grid", type=int, default=20, help="AWQ: grid points of the exponent search")
    p.add_argument("--awq-search-tokens", type=int, default=2048, help="AWQ: input rows per group in the search")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    options = {"awq": {"n_grid": args.awq_grid, "search_tokens": args.awq_search_tokens}}
    calib = CalibrationConfig(samples=args.calib_samples, seq_len=args.calib_len, corpus=args.corpus)
    results = [
        run_model(
            m,
            args.formats,
            args.tokens,
            args.keep_lm_head,
            args.corpus,
            args.windows,
            args.output_policy,
            calib,
            options,
        )
        for m in args.models
    ]
    if args.json:
        print(json.dumps({"results": results}))
        return 0
    for r in results:
        print(
            f"\n{r['model']}: perplexity on {r['tokens']} tokens of {r['corpus']} ({r['windows']} eval windows, "
            f"seed 0), lm_head policy {r['output_policy']}"
        )
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
