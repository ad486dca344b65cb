"""Perplexity per KV-cache codec on real text (Austen), against bf16 KV in the same run.

Each codec stores K/V of every layer and attention reads them back from the compressed pages (prefill
included), so the perplexity change is the codec's whole effect. Windows are ``--tokens`` long (≥ 2k by
default) from the evaluation split of the six novels (:mod:`bytediet.eval.corpus`). The paged block size is
32 so that KIVI's default group of 32 fits a page.

Codecs with calibration hooks (fp8's static scales; TurboQuant's channel means, outlier channels and
layout) are calibrated on ``--cal-windows`` windows of the *calibration* split (never evaluated on), from
K/V/Q captured once per model (:mod:`bytediet.kvcache.calibration`). ``--no-calibrate`` measures the
documented uncalibrated fallbacks instead (fp8: dynamic per-token scales; TurboQuant: no mean, outliers
from the first prefill).

    .venv/bin/python bench/kv_ppl.py [--models default gemma3-270m] [--codecs int8 turboquant3.5 ...]
                                     [--tokens 2048] [--windows 1] [--cal-windows 2] [--no-calibrate] [--json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from bytediet.eval.corpus import load_corpus, make_windows
from bytediet.kvcache import get_kv_codec
from bytediet.kvcache.calibration import calibrate_from_samples, capture_kv
from bytediet.models.loader import load_model

CODECS = ["fp32", "int8", "fp8", "kivi4", "kivi2", "qjl", "polarquant", "turboquant4", "turboquant3.5",
          "turboquant3", "turboquant2.5", "turboquant_prod3.5", "turboquant_prod2.5",
          "k=turboquant4,v=turboquant3"]
BLOCK_SIZE = 32


def perplexity(model, ids: torch.Tensor, codec) -> float:
    logits = model.score(ids, kv_codec=codec, block_size=BLOCK_SIZE)[:-1].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, ids[1:]).item())


def layouts(codec) -> str:
    """Key/value TurboQuant layouts actually used (after calibration), e.g. 'k [(32, 4), (32, 2)]'."""
    out = []
    for role in ("key_half", "value_half"):
        half = getattr(codec, role, None)
        if half is not None and hasattr(half, "layout"):
            out.append(f"{role[0]} {half.layout(CURRENT_HEAD_DIM[0])}")
    return "; ".join(out)


CURRENT_HEAD_DIM = [0]


def run_model(spec: str, codecs: list[str], n_tokens: int, n_windows: int, cal_windows: int) -> dict:
    model, tokenizer = load_model(spec, dtype=torch.float32)
    cfg = model.config
    CURRENT_HEAD_DIM[0] = cfg.head_dim
    ids = torch.tensor(tokenizer.encode(load_corpus("austen")), dtype=torch.long)
    windows = make_windows(ids, n_tokens, count=n_windows, split="eval", seed=0)
    samples = None
    if cal_windows:
        cal = make_windows(ids, 1024, count=cal_windows, split="calibration", seed=0)
        samples = capture_kv(model, [w.ids for w in cal], max_samples=4096)
    bf16_bytes = get_kv_codec("bf16").bytes_per_token(cfg.num_kv_heads, cfg.head_dim)
    base = sum(perplexity(model, w.ids, "bf16") for w in windows) / len(windows)
    rows = [{"codec": "bf16", "layout": "", "bits": 16.0, "x_smaller": 1.0, "ppl": base, "delta_pct": 0.0, "seconds": None}]
    for codec in codecs:
        c = get_kv_codec(codec)
        if samples is not None:
            calibrate_from_samples(c, samples)
        t0 = time.perf_counter()
        ppl = sum(perplexity(model, w.ids, c) for w in windows) / len(windows)
        rows.append({"codec": codec, "layout": layouts(c),
                     "bits": c.bits_per_coordinate(cfg.num_kv_heads, cfg.head_dim),
                     "x_smaller": bf16_bytes / c.bytes_per_token(cfg.num_kv_heads, cfg.head_dim),
                     "ppl": ppl, "delta_pct": 100 * (ppl / base - 1), "seconds": time.perf_counter() - t0})
        print(f"  {spec} {codec}: ppl {ppl:.4f} ({rows[-1]['delta_pct']:+.2f}%) {rows[-1]['layout']}",
              file=sys.stderr, flush=True)
    return {"model": spec, "head_dim": cfg.head_dim, "num_kv_heads": cfg.num_kv_heads, "tokens": n_tokens,
            "calibration_windows": cal_windows,
            "windows": [w.start for w in windows], "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["default"])
    ap.add_argument("--codecs", nargs="+", default=CODECS)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--cal-windows", type=int, default=2, help="1024-token calibration windows (0 = none)")
    ap.add_argument("--no-calibrate", action="store_true", help="measure the uncalibrated fallbacks")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    cal = 0 if args.no_calibrate else args.cal_windows
    results = [run_model(m, args.codecs, args.tokens, args.windows, cal) for m in args.models]
    if args.json:
        print(json.dumps({"kv_ppl": results}))
        return 0
    for r in results:
        print(f"\n{r['model']} (head_dim {r['head_dim']}, {r['num_kv_heads']} KV heads), "
              f"{r['tokens']}-token Austen windows at {r['windows']}")
        print(f"{'codec':32s} {'bits':>6s} {'vs bf16':>8s} {'ppl':>9s} {'Δ%':>7s}  layout")
        for row in r["rows"]:
            print(f"{row['codec']:32s} {row['bits']:6.3f} {row['x_smaller']:7.2f}x {row['ppl']:9.4f} "
                  f"{row['delta_pct']:+7.2f}  {row.get('layout', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
