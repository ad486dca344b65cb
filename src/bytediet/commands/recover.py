"""``bytediet recover``: fine-tune a pruned (mask frozen) or INT4 (codes frozen, scales trained) checkpoint back
towards its dense model.

    bytediet quantize --model default --format sparse24 --calibrate wanda --out pruned/
    bytediet recover --model pruned/ --steps 200 [--tokens BUDGET] [--seq-len 128] [--lr 1e-4] \\
                     [--state recover.pt] [--eval-windows 4 --eval-every 50] --out recovered/ [--json]
    bytediet generate --model recovered/ ...
    bytediet quantize --model default --format int4-g64 --out int4/ && bytediet recover --model int4/ ...

The teacher is the dense model the pruned checkpoint was made from (its recorded source), or
``--teacher``. Training windows come from the *calibration* split of ``--calib-corpus``; perplexity is
measured on its *evaluation* split (``--eval-windows`` × ``--eval-tokens``), before, every
``--eval-every`` steps and after, so the output reports perplexity against tokens trained. With
``--state FILE`` the run saves its state every ``--save-every`` steps and a rerun resumes from it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from ..errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser(
        "recover",
        help="fine-tune a pruned or INT4 model towards its dense model (KL distillation)",
        description="Train the kept weights of a pruned checkpoint (sparse24, sparse24-int8, sparse50; "
        "the sparsity mask frozen) or the group scales of an INT4 one (int4-g*; the codes "
        "frozen) to match the dense model's next-token distributions on calibration text, "
        "and save a bytediet checkpoint of the same format.",
    )
    p.add_argument(
        "--model", required=True, help="the pruned or INT4 bytediet checkpoint directory (bytediet quantize --out)"
    )
    p.add_argument("--teacher", default=None, help="the dense model (default: the source the checkpoint records)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--tokens", type=int, default=None, help="token budget: stop after this many training tokens")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training window (default 128)")
    p.add_argument("--batch", type=int, default=1, help="windows per optimizer step (default 1)")
    p.add_argument("--lr", type=float, default=1e-4, help="peak AdamW learning rate (default 1e-4)")
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps (default 10)")
    p.add_argument("--calib-corpus", default="austen", help="training text: a novel name, austen, or a text file")
    p.add_argument("--seed", type=int, default=1, help="seed of the training window choice")
    p.add_argument("--state", default=None, metavar="FILE", help="resumable training state (resumes when it exists)")
    p.add_argument("--save-every", type=int, default=25, help="steps between state saves (default 25)")
    p.add_argument("--eval-windows", type=int, default=4, help="evaluation windows for perplexity (0: none)")
    p.add_argument("--eval-tokens", type=int, default=512, help="tokens per evaluation window (default 512)")
    p.add_argument("--eval-every", type=int, default=0, help="steps between evaluations (default: before and after)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (on a busy machine 1 can be far faster than oversubscribed cores)",
    )
    p.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..calibrate import CalibrationConfig
    from ..calibrate.recover import Recovery, RecoveryConfig
    from ..eval.corpus import calibration_windows
    from ..models.checkpoint import TOKENIZER_DIR, TOKENIZER_GGUF, read_config, save_quantized
    from ..models.loader import load_model
    from ..progress import no_meter, rich_meter

    out, model_dir = Path(args.out), Path(args.model)
    if out.exists() and not args.overwrite:
        raise ConfigError(f"{out} already exists; choose another --out or pass --overwrite")
    if not model_dir.is_dir():
        raise ConfigError(
            f"--model {args.model}: recover takes a pruned or INT4 bytediet checkpoint directory "
            "(make one with bytediet quantize --format sparse24 --out DIR, or --format int4-g64)"
        )
    teacher_spec = args.teacher or (read_config(model_dir).get("source") or {}).get("path")
    if not teacher_spec:
        raise ConfigError(f"{model_dir} records no source model; pass the dense model as --teacher")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = RecoveryConfig(
        steps=args.steps,
        lr=args.lr,
        warmup=args.warmup,
        batch=args.batch,
        max_tokens=args.tokens,
        save_every=args.save_every,
        eval_every=args.eval_every,
    )
    t0 = time.perf_counter()
    student, tokenizer = load_model(model_dir, dtype=torch.float32)
    teacher, _ = load_model(teacher_spec, dtype=torch.float32, load_tokenizer=False)
    windows = calibration_windows(
        tokenizer, CalibrationConfig(args.steps * args.batch, args.seq_len, args.calib_corpus, args.seed)
    )
    evaluate = _perplexity_on(tokenizer, args.calib_corpus, args.eval_windows, args.eval_tokens)
    result = Recovery(student, teacher, windows, config, args.state).run(
        no_meter if args.no_progress else rich_meter, evaluate
    )
    tok_source = next((p for p in (model_dir / TOKENIZER_GGUF, model_dir / TOKENIZER_DIR) if p.exists()), None)
    save_quantized(student, tok_source, out, source_path=teacher_spec, overwrite=args.overwrite)
    report = {
        "model": str(model_dir),
        "teacher": str(teacher_spec),
        "out": str(out),
        **result,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if args.json:
        print(json.dumps(report))
    else:
        for h in result["history"]:
            print(f"step {h['step']:5d}  tokens {h['tokens']:9,d}  perplexity {h['ppl']:.3f}")
        print(
            f"recovered the pruned / INT4 layers of {model_dir} for {result['steps']} steps "
            f"({result['tokens']:,} tokens); "
            f"saved {out}",
            file=sys.stderr,
        )
    return 0


def _perplexity_on(tokenizer, corpus: str, count: int, length: int):
    """``evaluate(model) → {"ppl": …}`` on ``count`` windows of the corpus's evaluation split (BOS first), or None."""
    if count < 1:
        return None
    import torch
    import torch.nn.functional as F

    from ..eval.corpus import make_windows, tokenize_corpus

    windows = [w.ids for w in make_windows(tokenize_corpus(tokenizer, corpus), length, count=count, split="eval")]
    bos = torch.tensor(tokenizer.encode("", add_special_tokens=True), dtype=torch.long)

    def evaluate(model) -> dict:
        nll, n = 0.0, 0
        for ids in windows:
            logits = model.score(torch.cat([bos, ids]))[len(bos) : -1]
            nll += float(F.cross_entropy(logits.float(), ids[1:], reduction="sum"))
            n += len(ids) - 1
        return {"ppl": math.exp(nll / n)}

    return evaluate
