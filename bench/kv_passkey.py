"""Passkey retrieval per KV-cache codec: every codec against the unmodified model (its native KV) in one run.

The model is loaded once; the reference passkey run is done once (:class:`bytediet.eval.harness.ReferenceCache`)
and every codec then answers the same seeded prompts through the engine (chunked prefill of 1024 tokens, so
later chunks read the earlier ones back from the compressed pages, as in serving). Codecs with calibration
hooks are calibrated on ``--cal-windows`` 1024-token windows of the corpus's *calibration* split, from K/V/Q
captured once.

    .venv/bin/python bench/kv_passkey.py [--model default] [--codecs int8 turboquant3.5 ...]
                                         [--lengths 2048] [--depths 0.1,0.5,0.9] [--trials 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bytediet.calibrate.kv import calibrate_from_samples, capture_kv, has_calibration
from bytediet.commands._parse import floats, positive_ints
from bytediet.eval.corpus import make_windows, tokenize_corpus
from bytediet.eval.harness import EvalSettings, evaluate_loaded, reference_cache
from bytediet.kvcache import get_kv_codec
from bytediet.models.loader import load_model

CODECS = [
    "bf16",
    "int8",
    "fp8",
    "kivi4",
    "kivi2",
    "polarquant",
    "qjl",
    "turboquant4",
    "turboquant3.5",
    "turboquant2.5",
    "turboquant_prod3.5",
]


def run(
    model_spec: str,
    codecs: list[str],
    lengths: list[int],
    depths: list[float],
    trials: int,
    cal_windows: int,
    seed: int = 0,
) -> dict:
    model, tokenizer = load_model(model_spec, dtype=torch.float32)
    cfg = model.config
    settings = EvalSettings(
        corpus="austen",
        windows=1,
        window_len=512,
        seed=seed,
        tasks=("passkey",),
        passkey_lengths=tuple(lengths),
        passkey_depths=tuple(depths),
        passkey_trials=trials,
    )
    corpus_ids = tokenize_corpus(tokenizer, "austen")
    samples = None
    if cal_windows:
        cal = make_windows(corpus_ids, 1024, count=cal_windows, split="calibration", seed=0)
        samples = capture_kv(model, [w.ids for w in cal], max_samples=4096)
    reference = reference_cache(model_spec, settings)
    bf16_bytes = get_kv_codec("bf16").bytes_per_token(cfg.num_kv_heads, cfg.head_dim)
    rows = []
    for spec in codecs:
        codec = get_kv_codec(spec)
        if samples is not None and has_calibration(codec):
            calibrate_from_samples(codec, samples)
        t0 = time.perf_counter()
        result = evaluate_loaded(
            model,
            tokenizer,
            settings=settings,
            kv_cache_dtype=codec,
            reference=reference,
            corpus_ids=corpus_ids,
            progress=False,
            model_label=model_spec,
        )
        pk = result["tasks"]["passkey"]
        rows.append(
            {
                "codec": spec,
                "bits": codec.bits_per_coordinate(cfg.num_kv_heads, cfg.head_dim),
                "x_smaller": bf16_bytes / codec.bytes_per_token(cfg.num_kv_heads, cfg.head_dim),
                "accuracy": pk["test"]["accuracy"],
                "reference_accuracy": pk["reference"]["accuracy"],
                "cells": pk["test"]["cells"],
                "answers": pk["test"]["answers"],
                "seconds": time.perf_counter() - t0,
            }
        )
        print(
            f"  {model_spec} {spec}: {pk['test']['accuracy']:.3f} (reference {pk['reference']['accuracy']:.3f})",
            file=sys.stderr,
            flush=True,
        )
    ref = reference.results["passkey"]
    return {
        "model": model_spec,
        "head_dim": cfg.head_dim,
        "lengths": lengths,
        "depths": depths,
        "trials": trials,
        "calibration_windows": cal_windows,
        "reference": {"accuracy": ref["accuracy"], "cells": ref["cells"], "answers": ref["answers"]},
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--codecs", nargs="+", default=CODECS)
    ap.add_argument("--lengths", type=positive_ints, default=(2048,), help="comma-separated prompt lengths")
    ap.add_argument("--depths", type=floats, default=(0.1, 0.5, 0.9), help="comma-separated needle depths")
    ap.add_argument("--trials", type=int, default=2, help="trials per (length, depth)")
    ap.add_argument("--cal-windows", type=int, default=2, help="1024-token calibration windows (0 = none)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    result = run(args.model, args.codecs, list(args.lengths), list(args.depths), args.trials, args.cal_windows)
    if args.json:
        print(json.dumps({"kv_passkey": result}))
        return 0
    print(
        f"\n{result['model']}: passkey at {result['lengths']} tokens, depths {result['depths']}, "
        f"{result['trials']} trial(s) each; reference {result['reference']['accuracy']:.3f}"
    )
    print(f"{'codec':24s} {'bits':>6s} {'vs bf16':>8s} {'accuracy':>9s}")
    for row in result["rows"]:
        print(f"{row['codec']:24s} {row['bits']:6.3f} {row['x_smaller']:7.2f}x {row['accuracy']:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
