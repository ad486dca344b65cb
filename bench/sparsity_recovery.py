"""Prune (magnitude, Wanda, SparseGPT), then recover by distillation: perplexity against tokens trained.

For each method the model is pruned to ``--format`` (2:4 by default; ``sparse50`` for unstructured 50 %),
its perplexity measured on the Austen *evaluation* split (``--windows`` × ``--tokens``, BOS first, as in
``bench/quant_ppl.py``), then recovery fine-tuning (:mod:`bytediet.calibrate.recover`) trains the kept
weights against the dense model on ``--recover-len``-token windows of the *calibration* split, measuring
perplexity every ``--eval-every`` steps. States go to ``--state-dir`` (a rerun resumes each method).

    nice -n 10 .venv/bin/python bench/sparsity_recovery.py --model default --methods wanda sparsegpt \
        --recover-steps 200 --json > bench/results/sparsity-recovery-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_ppl import perplexity

from bytediet.calibrate import CalibrationConfig, calibrate_and_quantize
from bytediet.calibrate.recover import Recovery, RecoveryConfig
from bytediet.eval.corpus import calibration_windows, make_windows, tokenize_corpus
from bytediet.models.loader import load_model
from bytediet.models.quantize import QuantizeConfig, quantize
from bytediet.progress import rich_meter, rich_progress


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--format", default="sparse24")
    p.add_argument("--methods", nargs="+", default=["magnitude", "wanda", "sparsegpt"])
    p.add_argument("--corpus", default="austen")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--calib-len", type=int, default=512)
    p.add_argument("--recover-steps", type=int, default=200)
    p.add_argument("--recover-len", type=int, default=128)
    p.add_argument("--recover-batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--state-dir", default="/tmp/bytediet-recovery")
    p.add_argument("--save-dir", default=None, help="also save each recovered model as a bytediet checkpoint here")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine two threads ran 10× slower)",
    )
    p.add_argument("--out", default=None, help="write the JSON here after every method (partial results survive)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    teacher, tokenizer = load_model(args.model, dtype=torch.float32)
    ids = tokenize_corpus(tokenizer, args.corpus)
    evals = [w.ids for w in make_windows(ids, args.tokens, count=args.windows, split="eval", seed=0)]
    bos = tokenizer.encode("", add_special_tokens=True)
    base = perplexity(teacher, evals, bos)
    print(f"[{args.model}] dense ppl {base:.3f}", file=sys.stderr, flush=True)
    calib = CalibrationConfig(args.calib_samples, args.calib_len, args.corpus)
    calib_windows = calibration_windows(tokenizer, calib)
    train = calibration_windows(
        tokenizer, CalibrationConfig(args.recover_steps * args.recover_batch, args.recover_len, args.corpus, seed=1)
    )
    rcfg = RecoveryConfig(
        steps=args.recover_steps, lr=args.lr, batch=args.recover_batch, eval_every=args.eval_every, save_every=10
    )
    rows = []

    def summary():
        return {
            "model": args.model,
            "format": args.format,
            "dense_ppl": base,
            "eval": f"{args.windows} × {args.tokens}",
            "calibration": calib.to_dict(),
            "recovery_windows": f"{train.shape[0]} × {train.shape[1]}",
            "threads": args.threads,
            "rows": rows,
        }

    for method in args.methods:
        student, _ = load_model(args.model, dtype=torch.float32)
        config = QuantizeConfig(format=args.format)
        t0 = time.perf_counter()
        if method == "magnitude":
            quantize(student, config)
        else:
            calibrate_and_quantize(student, config, method, calib_windows, calib, rich_progress)
        prune_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        state = Path(args.state_dir) / f"{Path(str(args.model)).stem}-{args.format}-{method}.pt"

        def evaluate(model):
            ppl = perplexity(model, evals, bos)
            print(f"  [{method}] ppl {ppl:.3f} ({100 * (ppl / base - 1):+.1f} %)", file=sys.stderr, flush=True)
            return {"ppl": ppl, "delta_pct": 100 * (ppl / base - 1)}

        result = Recovery(student, teacher, train, rcfg, state).run(rich_meter, evaluate)
        rows.append(
            {
                "method": method,
                "prune_seconds": round(prune_s, 1),
                "recover_seconds_this_run": round(time.perf_counter() - t0, 1),
                **result,
            }
        )
        if args.save_dir:
            from bytediet.models.checkpoint import save_quantized

            save_quantized(student, teacher.source_path, Path(args.save_dir) / method, overwrite=True)
        if args.out:
            Path(args.out).write_text(json.dumps(summary(), indent=1))
    if args.json:
        print(json.dumps(summary()))
    else:
        for r in rows:
            print(r["method"], [(h["tokens"], round(h["ppl"], 2)) for h in r["history"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
