"""Per-channel key magnitude statistics of a model, per layer, before and after RoPE (issue 29).

The keys every attention layer writes on ``--windows`` × ``--window-len`` tokens of the corpus's evaluation split
(no BOS), measured by :func:`bytediet.calibrate.key_stats.key_stats`: max/median channel RMS, the top 1/16 channels'
share of the key energy, channels above ``--threshold`` × the median, kurtosis and the channel means' energy share.

    PYTHONPATH=src .venv/bin/python bench/kv_key_stats.py --model qwen2.5-0.5b --windows 2 --window-len 1024 --json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bytediet.calibrate.key_stats import STATS, key_stats
from bytediet.eval.corpus import make_windows, tokenize_corpus
from bytediet.models.loader import load_model


def run(model_spec: str, corpus: str, windows: int, window_len: int, threshold: float, seed: int) -> dict:
    t0 = time.perf_counter()
    model, tokenizer = load_model(model_spec, dtype=torch.float32)
    wins = make_windows(tokenize_corpus(tokenizer, corpus), window_len, windows, split="eval", seed=seed)
    stats = key_stats(model, [w.ids for w in wins], threshold=threshold)
    c = model.config
    return {
        "model": model_spec,
        "model_name": c.name,
        "num_layers": c.num_layers,
        "num_kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "settings": {"corpus": corpus, "windows": windows, "window_len": window_len, "seed": seed},
        "window_starts": [w.start for w in wins],
        **stats,
        "elapsed_s": time.perf_counter() - t0,
    }


def table(result: dict) -> str:
    """Per layer and side, the statistics as text columns."""
    head = f"{'layer':>5} {'side':>4} " + " ".join(f"{n:>16}" for n in STATS) + "  top (head, ch)"
    lines = [f"{result['model_name']}: {result['tokens']} keys per layer, threshold {result['threshold']:g}", head]
    for layer in result["layers"]:
        for side in ("pre", "post"):
            s = layer[side]
            if s is not None:
                cells = " ".join(f"{s[n]:>16.4g}" for n in STATS)
                lines.append(f"{layer['layer']:>5} {side:>4} {cells}  {tuple(s['top_channel'])}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="model name or path (default: SmolLM2-135M)")
    p.add_argument("--corpus", default="prideprejudice", help="an Austen novel, 'austen' or a text file")
    p.add_argument("--windows", type=int, default=2, help="windows of the evaluation split (default 2)")
    p.add_argument("--window-len", type=int, default=1024, help="tokens per window (default 1024)")
    p.add_argument("--threshold", type=float, default=4.0, help="outlier: channel RMS above this × the median")
    p.add_argument("--seed", type=int, default=0, help="picks the windows")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    result = run(args.model, args.corpus, args.windows, args.window_len, args.threshold, args.seed)
    print(json.dumps(result) if args.json else table(result))


if __name__ == "__main__":
    main()
