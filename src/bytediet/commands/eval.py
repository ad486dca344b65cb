"""``bytediet eval``: one configuration against the unmodified model — fidelity, passkey, speed/memory."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import ConfigError
from ._engine_args import _needs_calibration, add_device_flag, resolved_device
from ._parse import floats, positive_ints


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval", help="measure a weight format / KV codec against the unmodified model", description=__doc__
    )
    p.add_argument("--model", default="default", help="model name or path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--weights", default=None, help="weight format applied to every linear layer (e.g. int8, int4-g64)")
    p.add_argument("--kv-cache-dtype", default=None, help="KV-cache codec (e.g. bf16, int8, turboquant3.5)")
    p.add_argument(
        "--kv-calib-windows",
        type=int,
        default=None,
        metavar="N",
        help="calibrate a KV codec that has calibration hooks (fp8, turboquant) on N windows of "
        "--kv-calib-len tokens of the corpus's calibration split (default: 2 for the codecs that need "
        "it — budgets, TurboQuant — else none; 0: uncalibrated fallback)",
    )
    p.add_argument("--kv-calib-len", type=int, default=1024, help="tokens per KV calibration window (default 1024)")
    p.add_argument(
        "--kv-offload-codec",
        default=None,
        metavar="CODEC",
        help="score the KV as the KV tiers bring it back when they re-encode blocks at rest with CODEC "
        "(serve --kv-offload-codec): every full block of the context round-tripped through it (ppl only)",
    )
    p.add_argument("--windows", type=int, default=8, help="evaluation windows (default 8)")
    p.add_argument("--window-len", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--corpus", default="prideprejudice", help="an Austen novel, 'austen' (all six) or a text file")
    p.add_argument("--seed", type=int, default=0, help="picks the windows and the passkeys")
    p.add_argument("--tasks", default="ppl,passkey,speed", help="comma-separated: ppl, passkey, speed")
    p.add_argument(
        "--passkey-lengths",
        default=None,
        help="prompt lengths in tokens (default 1024,2048,4096, clipped to the context; with --kv-pareto "
        "2048,4096,8192, lengths beyond the context skipped)",
    )
    p.add_argument(
        "--passkey-depths",
        default=None,
        help="needle depths, fractions of the filler (default 0,0.25,0.5,0.75,1; with --kv-pareto 0.25,0.5,0.75)",
    )
    p.add_argument("--passkey-trials", type=int, default=1, help="trials per (length, depth)")
    p.add_argument("--speed-tokens", type=int, default=32, help="tokens generated for the speed measurement")
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split the reference and the test model each across N processes (each loads its own "
        "shard); every task runs through the split model. Not with --kv-pareto or KV calibration",
    )
    p.add_argument(
        "--kv-pareto",
        action="store_true",
        help="instead of one configuration: every KV anchor (llama.cpp q8_0/q5_0/q4_1/q4_0 and k=q8_0,v=q4_0, "
        "vLLM fp8, HF QuantizedCache hf4/hf2, KIVI), bytediet's codecs and budgets auto:<bits>, on the "
        "same windows against bf16 KV: perplexity change, mean/p99 token KL, bytes per token, frontier",
    )
    p.add_argument(
        "--kv-pareto-anchors",
        default=None,
        help="anchor specs, comma-separated (semicolons when a spec holds a comma: q8_0;k=q8_0,v=q4_0)",
    )
    p.add_argument("--kv-pareto-codecs", default=None, help="bytediet codec specs, separated as the anchors")
    p.add_argument(
        "--kv-pareto-budgets",
        default=None,
        help="comma-separated budgets in bits per coordinate (default 8.5,6,4.5,3.5; 'none' for none)",
    )
    p.add_argument(
        "--kv-pareto-candidates",
        default=None,
        help="the codecs the budgets' plans choose from per layer, separated as the anchors (default: "
        "calibrate/kv_candidates.py's DEFAULT_CANDIDATES); k=<spec> or v=<spec> offers only that codec's key or value "
        "half (k=kivi4g16,k=kivi2g16 add KIVI's per-channel keys)",
    )
    p.add_argument(
        "--kv-pareto-journal",
        default=None,
        metavar="FILE",
        help="--kv-pareto: write each finished entry to FILE at once; a rerun with the same model and settings "
        "measures only the entries FILE lacks (for runs of hours: stop and resume)",
    )
    p.add_argument(
        "--capacity-memory",
        default=None,
        metavar="SIZE",
        help="--kv-pareto: KV memory (e.g. 1GiB) in which each entry's concurrent 4096-token sequences are "
        "counted (default: what 16 such sequences take in bf16)",
    )
    add_device_flag(
        p,
        "where both models and their engines run (auto: cuda where torch sees a GPU; -tp and --kv-pareto: the "
        "CPU); on cuda the linears and the paged attention run Triton kernels (docs/gpu.md)",
    )
    p.add_argument("--plot", metavar="DIR", default=None, help="write PNG figures into DIR")
    p.add_argument("--json", action="store_true", help="print one JSON object with every number")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    p.set_defaults(handler=run)


def settings_from_args(args: argparse.Namespace):
    from ..eval.harness import EvalSettings

    tasks = tuple(t.strip().lower() for t in args.tasks.split(",") if t.strip())
    return EvalSettings(
        corpus=args.corpus,
        windows=args.windows,
        window_len=args.window_len,
        seed=args.seed,
        tasks=tasks,
        passkey_lengths=positive_ints(args.passkey_lengths or "1024,2048,4096"),
        passkey_depths=floats(args.passkey_depths or "0,0.25,0.5,0.75,1"),
        passkey_trials=args.passkey_trials,
        speed_new_tokens=args.speed_tokens,
    )


def run(args: argparse.Namespace) -> int:
    tp = args.tensor_parallel_size
    if tp < 1:
        raise ConfigError(f"--tensor-parallel-size must be at least 1, got {tp}")
    if args.kv_pareto and tp > 1:
        raise ConfigError(
            f"--kv-pareto scores every KV codec (and calibrates the budgets) on the whole model in one "
            f"process; it does not run at --tensor-parallel-size {tp}: drop -tp, or evaluate one codec "
            "with --kv-cache-dtype"
        )
    if args.kv_pareto:
        if resolved_device("cpu" if args.device == "auto" else args.device) == "cuda":
            raise ConfigError(
                "--kv-pareto runs on the CPU (its anchors' KV pages have no GPU kernels); drop --device cuda, "
                "or evaluate one codec with --kv-cache-dtype on the GPU"
            )
        return run_kv_pareto(args)
    device = resolved_device(args.device, tp)
    from ..eval.harness import evaluate
    from ..perf.memory import peak_rss_bytes
    from ._memory import announce, plan_eval

    plan = None
    if tp == 1:  # refuse before loading what the machine cannot hold
        plan = announce(plan_eval(args.model, args.weights, args.windows, args.window_len))

    kv_calibration = None
    if args.kv_calib_windows is None:  # a budget needs its plan, TurboQuant its means: the default calibration
        args.kv_calib_windows = 2 if args.kv_cache_dtype and _needs_calibration(args.kv_cache_dtype) else 0
    if args.kv_calib_windows > 0:
        kv_calibration = {
            "corpus": args.corpus,
            "windows": args.kv_calib_windows,
            "window_len": args.kv_calib_len,
            "seed": args.seed,
        }
    result = evaluate(
        args.model,
        weights=args.weights,
        kv_cache_dtype=args.kv_cache_dtype,
        settings=settings_from_args(args),
        progress=not args.no_progress,
        kv_calibration=kv_calibration,
        tensor_parallel_size=tp,
        device=device,
        kv_offload_codec=args.kv_offload_codec,
    )
    if plan is not None:
        result["memory"] = {**plan.to_dict(), "measured_peak_bytes": peak_rss_bytes()}
    if args.plot:
        from ..eval.plots import write_plots

        result["plots"] = [str(p) for p in write_plots(result, args.plot)]
    if args.json:
        print(json.dumps(result, default=float))
        return 0
    from rich.console import Console

    Console(file=sys.stdout, width=120).print(render_table(result))
    if result["config"].get("kv_plan"):
        print(result["config"]["kv_plan_table"])
    for path in result.get("plots", []):
        print(f"wrote {path}")
    return 0


def _specs(text, default):
    return default if text is None else tuple(s.strip() for s in text.split(";" if ";" in text else ",") if s.strip())


def run_kv_pareto(args: argparse.Namespace) -> int:
    """``--kv-pareto``: the table (or one JSON object) and, with ``--plot DIR``, ``DIR/kv_pareto.png``."""
    import torch

    from ..calibrate.kv_budget import DEFAULT_CANDIDATES
    from ..config import parse_bytes
    from ..eval import kv_pareto as kp
    from ..kernels.backend import describe
    from ..models.loader import load_model
    from ..perf.memory import peak_rss_bytes
    from ..progress import no_progress, rich_progress
    from ._memory import announce, plan_kv_pareto

    passkey = "passkey" in (t.strip().lower() for t in args.tasks.split(","))
    passkey_lengths = positive_ints(args.passkey_lengths or "2048,4096,8192") if passkey else ()
    calib_windows = max(args.kv_calib_windows or 0, 1)
    plan = announce(
        plan_kv_pareto(
            args.model,
            args.weights,
            args.windows,
            args.window_len,
            calib_windows,
            args.kv_calib_len,
            passkey_lengths,
        )
    )  # refuse before loading what the machine cannot hold
    model, tokenizer = load_model(args.model, dtype=torch.float32, weights=args.weights)
    budgets = (
        kp.BUDGETS
        if args.kv_pareto_budgets is None
        else (() if args.kv_pareto_budgets.strip().lower() == "none" else floats(args.kv_pareto_budgets))
    )
    result = kp.kv_pareto(
        model,
        tokenizer,
        corpus=args.corpus,
        windows=args.windows,
        window_len=args.window_len,
        seed=args.seed,
        anchors=_specs(args.kv_pareto_anchors, kp.ANCHORS),
        ours=_specs(args.kv_pareto_codecs, kp.OURS),
        budgets=budgets,
        candidates=_specs(args.kv_pareto_candidates, DEFAULT_CANDIDATES),
        calib_windows=calib_windows,
        calib_len=args.kv_calib_len,
        passkey_lengths=passkey_lengths,
        passkey_depths=floats(args.passkey_depths or "0.25,0.5,0.75"),
        passkey_trials=args.passkey_trials,
        capacity_memory=parse_bytes(args.capacity_memory) if args.capacity_memory else None,
        progress=no_progress if args.no_progress else rich_progress,
        journal=args.kv_pareto_journal,
    )  # bars go to stderr
    result["device"] = describe("cpu")
    result["memory"] = {**plan.to_dict(), "measured_peak_bytes": peak_rss_bytes()}
    if args.plot:
        result["plots"] = [str(kp.plot_kv_pareto(result, f"{args.plot}/kv_pareto.png"))]
    if args.json:
        print(json.dumps(result, default=float))
        return 0
    from rich.console import Console

    Console(file=sys.stdout, width=160).print(pareto_table(result))
    for note in result["notes"]:
        print(note)
    for path in result.get("plots", []):
        print(f"wrote {path}")
    return 0


def pareto_table(result: dict):
    """The --kv-pareto table: the bf16 reference row, then every entry by bytes per token (* = frontier)."""
    from rich.table import Table

    ref, st = result["reference"], result["settings"]
    lengths = st["passkey_lengths"] if ref["passkey"] else []
    mib = st["capacity_memory"] / 2**20
    table = Table(
        title=f"{result['model_name']}: KV codecs vs bf16 KV (ppl {ref['ppl']:.4f}, "
        f"{ref['bytes_per_token']:.0f} B/token); * = frontier; passkey retrieved/trials; "
        f"seq@{st['capacity_len']}: concurrent sequences in {mib:.0f} MiB of KV memory"
    )
    cols = ["codec", "kind", "bits/coord", "bytes/token", "ppl Δ %", "KL mean", "KL p99"]
    cols += [f"pk@{n}" for n in lengths] + [f"seq@{st['capacity_len']}"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("codec", "kind") else "right", no_wrap=True)

    def checks(r):
        pk = [f"{p['retrieved']}/{p['trials']}" for p in r["passkey"] or []]
        return pk + [str(r["capacity"]["sequences"])]

    table.add_row(
        "  bf16 (reference)", "reference", "16.000", f"{ref['bytes_per_token']:.0f}", "+0.000", "0", "0", *checks(ref)
    )
    for r in sorted(result["records"], key=lambda r: r.get("bytes_per_token", 0)):
        if "error" in r:
            table.add_row(r["spec"], r["kind"], "", "", r["error"][:60], *[""] * (len(cols) - 5))
            continue
        table.add_row(
            ("* " if r.get("frontier") else "  ") + r["spec"],
            r["kind"],
            f"{r['bits_per_coordinate']:.3f}",
            f"{r['bytes_per_token']:.0f}",
            f"{r['ppl_change_pct']:+.3f}",
            f"{r['kl_mean']:.2e}",
            f"{r['kl_p99']:.2e}",
            *checks(r),
        )
    return table


def format_value(value: Any) -> str:
    """How a number appears in the table: integers exactly, floats to 6 significant digits, None blank."""
    if value is None:
        return ""
    if isinstance(value, bool) or isinstance(value, int):
        return str(int(value))
    return f"{value:.6g}"


def table_rows(result: dict) -> list[tuple[str, str, Any, Any]]:
    """(task title, metric, reference value, test value) for every task in ``result``, in run order."""
    from ..eval.tasks import get_eval_task

    rows = []
    for name, task_result in result["tasks"].items():
        task = get_eval_task(name)
        rows += [(task.title, metric, ref, test) for metric, ref, test in task.rows(task_result)]
    return rows


def render_table(result: dict):
    from rich.table import Table

    cfg, ref = result["config"], result["reference_config"]
    blocks = cfg.get("native_blocks") or {}
    weights = cfg["weights"] or ("as loaded" + (f" ({'/'.join(blocks)} blocks, native)" if blocks else ""))
    tp = result.get("tensor_parallel_size", 1)
    table = Table(
        title=f"{result['model_name']}: weights={weights}, kv={cfg['kv_codec']} "
        f"vs unmodified ({ref['dtype']}, kv={ref['kv_codec']})" + (f", both across {tp} processes" if tp > 1 else "")
    )
    for column, justify in (("task", "left"), ("metric", "left"), ("reference", "right"), ("test", "right")):
        table.add_column(column, justify=justify, no_wrap=True)
    for task, metric, ref, test in table_rows(result):
        table.add_row(task, metric, format_value(ref), format_value(test))
    return table
