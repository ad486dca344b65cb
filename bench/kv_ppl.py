"""Perplexity per KV-cache codec on real text (Austen), against bf16 KV in the same run.

Each codec stores K/V of every layer and attention reads them back from the compressed pages (prefill
included), so the perplexity change is the codec's whole effect. Also reported: the mean per-token KL of the
codec's next-token distribution from bf16 KV's (never negative, so less noisy than a perplexity difference on
few windows, which a small perturbation can move either way), and each window's own perplexity change. Windows are
``--tokens`` long (≥ 2k by default) from the evaluation split of the six novels (:mod:`bytediet.eval.corpus`). The
paged block size is 32 so that KIVI's default group of 32 fits a page.

Codecs with calibration hooks (fp8's static scales; TurboQuant's channel means, outlier channels and
layout) are calibrated on ``--cal-windows`` windows of the *calibration* split (never evaluated on), from
K/V/Q captured once per model (:mod:`bytediet.calibrate.kv`). ``--no-calibrate`` measures the
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

from bytediet.calibrate.kv import calibrate_from_samples, capture_kv
from bytediet.eval.corpus import load_corpus, make_windows
from bytediet.kvcache import get_kv_codec
from bytediet.models.loader import load_model

CODECS = [
    "fp32",
    "int8",
    "fp8",
    "kivi4",
    "kivi2",
    "qjl",
    "polarquant",
    "turboquant4",
    "turboquant3.5",
    "turboquant3",
    "turboquant2.5",
    "turboquant_prod3.5",
    "turboquant_prod2.5",
    "k=turboquant4,v=turboquant3",
]
BLOCK_SIZE = 32


def log_probs(model, ids: torch.Tensor, codec) -> torch.Tensor:
    """(L − 1, vocab) next-token log-probabilities of one window with ``codec`` storing the KV cache."""
    return torch.log_softmax(model.score(ids, kv_codec=codec, block_size=BLOCK_SIZE)[:-1].float(), dim=-1)


def nll_and_kl(logp: torch.Tensor, base: torch.Tensor, ids: torch.Tensor) -> tuple[float, float]:
    """Mean NLL of the window's tokens, and mean KL(base ‖ logp) per token (bf16 KV as the base)."""
    nll = -logp.gather(1, ids[1:, None]).mean().item()
    kl = (base.exp() * (base - logp)).sum(-1).mean().item()
    return nll, kl


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
    built = []
    for codec in codecs:
        c = get_kv_codec(codec)
        if samples is not None:
            calibrate_from_samples(c, samples)
        built.append(c)
    # windows outer, codecs inner: one window's bf16 log-probs in memory at a time (Gemma's vocab is 262k)
    base_nll, nll, kl, seconds = [], [[] for _ in codecs], [[] for _ in codecs], [0.0] * len(codecs)
    for w in windows:
        base = log_probs(model, w.ids, "bf16")
        base_nll.append(nll_and_kl(base, base, w.ids)[0])
        for i, c in enumerate(built):
            t0 = time.perf_counter()
            n, k = nll_and_kl(log_probs(model, w.ids, c), base, w.ids)
            nll[i].append(n)
            kl[i].append(k)
            seconds[i] += time.perf_counter() - t0
        del base
    # perplexity over all evaluated tokens (windows have equal length): exp of the mean NLL
    base_ppl = math.exp(sum(base_nll) / len(base_nll))
    rows = [
        {
            "codec": "bf16",
            "layout": "",
            "bits": 16.0,
            "x_smaller": 1.0,
            "ppl": base_ppl,
            "delta_pct": 0.0,
            "kl": 0.0,
            "window_delta_pct": [0.0] * len(windows),
            "seconds": None,
        }
    ]
    for i, (codec, c) in enumerate(zip(codecs, built)):
        ppl = math.exp(sum(nll[i]) / len(nll[i]))
        rows.append(
            {
                "codec": codec,
                "layout": layouts(c),
                "bits": c.bits_per_coordinate(cfg.num_kv_heads, cfg.head_dim),
                "x_smaller": bf16_bytes / c.bytes_per_token(cfg.num_kv_heads, cfg.head_dim),
                "ppl": ppl,
                "delta_pct": 100 * (ppl / base_ppl - 1),
                "kl": sum(kl[i]) / len(kl[i]),
                "window_delta_pct": [100 * (math.exp(a - b) - 1) for a, b in zip(nll[i], base_nll)],
                "seconds": seconds[i],
            }
        )
        print(
            f"  {spec} {codec}: ppl {ppl:.4f} ({rows[-1]['delta_pct']:+.2f}%, per window "
            f"{', '.join(f'{d:+.2f}' for d in rows[-1]['window_delta_pct'])}), KL {rows[-1]['kl']:.5f} "
            f"{rows[-1]['layout']}",
            file=sys.stderr,
            flush=True,
        )
    return {
        "model": spec,
        "head_dim": cfg.head_dim,
        "num_kv_heads": cfg.num_kv_heads,
        "tokens": n_tokens,
        "calibration_windows": cal_windows,
        "windows": [w.start for w in windows],
        "rows": rows,
    }


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
        print(
            f"\n{r['model']} (head_dim {r['head_dim']}, {r['num_kv_heads']} KV heads), "
            f"{r['tokens']}-token Austen windows at {r['windows']}"
        )
        print(f"{'codec':32s} {'bits':>6s} {'vs bf16':>8s} {'ppl':>9s} {'Δ%':>7s} {'KL':>8s}  layout")
        for row in r["rows"]:
            print(
                f"{row['codec']:32s} {row['bits']:6.3f} {row['x_smaller']:7.2f}x {row['ppl']:9.4f} "
                f"{row['delta_pct']:+7.2f} {row['kl']:8.5f}  {row.get('layout', '')}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
