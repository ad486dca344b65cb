"""``bytediet optimize``: measure, try every technique one at a time under an accuracy budget, recommend a config.

Writes into ``--out`` (default ``./bytediet-optimize/<model>``): a table per step, ``report.json``,
``summary.md``, ``recommended.json`` (for ``generate/serve --config``), ``pareto.png`` and
``roofline.png``. Completed measurements are cached there, so a killed run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ..errors import ConfigError
from ._engine_args import add_device_flag, resolved_device
from ._parse import floats, positive_ints


def _specs(text):
    if text is None:
        return None
    specs = tuple(s.strip() for s in text.split(",") if s.strip())
    if not specs:
        raise ConfigError(f"expected a comma-separated list of specs, got {text!r}")
    return specs


def _lengths(text):
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    return positive_ints(text, "--passkey-lengths")


def _budgets(text):
    if text is None:
        return None
    return () if text.strip().lower() == "none" else floats(text, "--kv-budgets")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "optimize", help="find the fastest (or smallest) configuration within an accuracy budget", description=__doc__
    )
    p.add_argument("--model", default="default", help="model name or path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default=None, metavar="DIR", help="output directory (default ./bytediet-optimize/<model>)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="demo preset: 4 windows of 512 tokens, one candidate per main family (plus AWQ and Wanda), "
        "passkey at 1024 tokens, short speed runs (about 10 minutes on 2 cores)",
    )
    p.add_argument(
        "--objective",
        default="throughput",
        choices=["throughput", "memory"],
        help="what to maximise within the budget: decode tok/s, or fewest bytes (weights + KV)",
    )
    p.add_argument(
        "--max-ppl-increase",
        type=float,
        default=2.0,
        metavar="PCT",
        help="accuracy budget: largest perplexity increase in percent (default 2)",
    )
    p.add_argument(
        "--max-kl",
        type=float,
        default=None,
        metavar="NATS",
        help="accuracy budget: largest mean next-token KL divergence (default: no limit)",
    )
    p.add_argument(
        "--max-passkey-drop",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="accuracy budget: passkey retrieval accuracy a configuration may lose against the "
        "unmodified model (default 0: retrieve all it retrieves; -1: no limit)",
    )
    p.add_argument(
        "--max-activation-ppl-cost",
        type=float,
        default=0.3,
        metavar="POINTS",
        help="a faster activation precision (e.g. int4-g64-a8 over int4-g64) may add at most this many "
        "percentage points of perplexity to the same weights (default 0.3)",
    )
    p.add_argument(
        "--max-activation-top1-drop",
        type=float,
        default=0.01,
        metavar="FRACTION",
        help="... and lose at most this much top-1 agreement (default 0.01)",
    )
    p.add_argument(
        "--passkey-lengths",
        default=None,
        help="passkey prompt lengths in tokens (quick 1024, full 1024,2048,4096; 'none' to skip)",
    )
    p.add_argument(
        "--weights",
        default=None,
        help="only these weight formats (comma-separated specs; FORMAT+METHOD for a calibrated one, "
        "e.g. int4-g64,int4-g64+gptq)",
    )
    p.add_argument(
        "--methods",
        default=None,
        help="calibration methods to try (comma-separated: awq,gptq,smoothquant,wanda; 'none' for none)",
    )
    p.add_argument("--calib-samples", type=int, default=None, help="calibration windows (quick 8, full 32)")
    p.add_argument("--calib-len", type=int, default=None, help="tokens per calibration window (quick 256, full 512)")
    p.add_argument("--kv", default=None, help="only these KV codecs (comma-separated specs; budgets as auto:<bits>)")
    p.add_argument(
        "--kv-budgets",
        default=None,
        metavar="BITS",
        help="KV byte budgets auto:<bits>, planned per layer by calibration, tried beside the registered "
        "codecs (comma-separated bits per coordinate; quick 4.5, full 8.5,6,4.5,3.5; 'none' for none)",
    )
    p.add_argument("--corpus", default="prideprejudice", help="an Austen novel, 'austen', or a UTF-8 text FILE")
    p.add_argument("--windows", type=int, default=None, help="evaluation windows (quick 4, full 8)")
    p.add_argument("--window-len", type=int, default=None, help="tokens per window (quick 512, full 1024)")
    p.add_argument("--context", type=int, default=2048, help="sequence length for the memory figure (default 2048)")
    p.add_argument("--seed", type=int, default=0, help="picks the evaluation windows")
    p.add_argument(
        "--time-budget",
        default=None,
        metavar="DURATION",
        help="measure the candidates that fit in this time, most promising first, and list the rest as "
        "skipped (e.g. 15m, 1.5h, 900s; default 15m with --quick, none otherwise; 'none': no limit)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (also keys this machine's roofline)")
    add_device_flag(
        p,
        "where the models, their engines and the calibration run (auto: cuda where torch sees a GPU); on cuda "
        "what has no GPU kernel is skipped and listed in report.json's device.skipped (docs/gpu.md)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (the report) instead of tables")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    p.set_defaults(handler=run)


def default_out(model: str) -> Path:
    from ..models.loader import MODEL_ALIASES

    stem = Path(model).stem if model.lower() not in MODEL_ALIASES else model
    return Path("bytediet-optimize") / re.sub(r"[^A-Za-z0-9_.-]+", "_", stem)


def options_from_args(args: argparse.Namespace):
    from ..optimize.budget import Budget
    from ..optimize.recipe import OptimizeOptions

    return OptimizeOptions(
        model=args.model,
        quick=args.quick,
        objective=args.objective,
        budget=Budget(
            args.max_ppl_increase,
            args.max_kl,
            None if args.max_passkey_drop < 0 else args.max_passkey_drop,
            args.max_activation_ppl_cost,
            args.max_activation_top1_drop,
        ),
        corpus=args.corpus,
        seed=args.seed,
        context=args.context,
        windows=args.windows,
        window_len=args.window_len,
        weights=_specs(args.weights),
        kv=_specs(args.kv),
        kv_budgets=_budgets(args.kv_budgets),
        threads=args.threads,
        methods=() if (args.methods or "").strip().lower() == "none" else _specs(args.methods),
        calib_samples=args.calib_samples,
        calib_len=args.calib_len,
        passkey_lengths=_lengths(args.passkey_lengths),
        time_budget=_time_budget(args.time_budget),
        device=resolved_device(args.device),  # cuda without a GPU: refused here, before anything is loaded
    )


def _time_budget(text):
    from ..optimize.timebudget import parse_duration

    if text is None:
        return None
    seconds = parse_duration(text)
    return 0.0 if seconds is None else seconds


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from ..optimize.recipe import Recipe
    from ..optimize.report import profile_table, recommend, step_table, write_outputs

    torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else default_out(args.model)
    console = Console(file=sys.stdout, width=170)

    def show(step: str, report: dict) -> None:
        if args.json:
            return
        if step != "profile":
            recommend(report)  # marks "in budget" on the rows shown so far
        console.print(profile_table(report) if step == "profile" else step_table(report, step))

    recipe = Recipe(options_from_args(args), out, on_step=show, progress=not args.no_progress)
    report = recipe.run()
    recommend(report)
    checkpoint = recipe.materialize(report)
    paths = write_outputs(report, out)
    if args.json:
        print(json.dumps(report, default=float))
        return 0
    rec = report["recommendation"]
    console.print(
        f"\n[bold]{'Recommended' if rec['within_budget'] else 'Budget impossible — closest'}:[/bold] "
        f"{rec['label']}\n{rec['reason']}"
    )
    for name in ("summary", "recommended", "report", "pareto", "roofline"):
        console.print(f"wrote {paths[name]}")
    if checkpoint is not None:
        console.print(f"wrote {checkpoint} (the calibrated weights recommended.json loads)")
    console.print(f"finished in {report['elapsed_s']:.0f} s")
    return 0
