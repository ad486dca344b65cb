"""``bytediet quantize``: quantize a checkpoint (optionally calibrated / mixed precision) and save it.

    bytediet quantize --model M --format F [--calibrate awq|gptq|smoothquant|wanda|sparsegpt]
                      [--calib-samples N --calib-len L]
                      [--overrides 'pattern=fmt,…'] [--max-kl X | --max-ppl-increase P] --out DIR
                      [--export-gguf FILE --gguf-type q8_0] [--json]

A pruned checkpoint (sparse24, sparse24-int8, sparse50) is fine-tuned back towards the dense model by
``bytediet recover`` (:mod:`bytediet.commands.recover`). The output directory is written atomically by
:func:`bytediet.models.checkpoint.save_quantized` (nothing is left behind on error); ``bytediet generate --model DIR``
loads it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..errors import ConfigError
from ._engine_args import add_device_flag, resolved_device


def register(sub) -> None:
    p = sub.add_parser(
        "quantize",
        help="quantize a model's weights and save the result",
        description="Quantize every linear layer (round to nearest, or calibrated with AWQ / GPTQ / "
        "SmoothQuant; optionally per-block mixed precision under a KL or perplexity "
        "budget) and save a bytediet checkpoint.",
    )
    p.add_argument("--model", default="default", help="GGUF file, Hugging Face directory, or 'default' / 'gemma3-270m'")
    p.add_argument("--format", required=True, help="weight format, e.g. int8, int4-g128, int8-w8a8, nvfp4")
    p.add_argument(
        "--calibrate",
        choices=["awq", "gptq", "smoothquant", "wanda", "sparsegpt"],
        default=None,
        help="calibration method (default: round to nearest)",
    )
    p.add_argument("--calib-samples", type=int, default=128, help="calibration windows (default 128)")
    p.add_argument("--calib-len", type=int, default=512, help="tokens per calibration window (default 512)")
    p.add_argument("--calib-corpus", default="austen", help="calibration text: a novel name, austen, or a text file")
    p.add_argument("--seed", type=int, default=0, help="seed of the calibration window choice")
    p.add_argument(
        "--overrides",
        default="",
        metavar="PATTERN=FMT,…",
        help="per-layer formats by glob pattern, first match wins (e.g. 'lm_head=int8,*.layers.0.*=int8')",
    )
    p.add_argument("--skip", default="", metavar="PATTERN,…", help="layers left as loaded")
    p.add_argument(
        "--output-policy",
        choices=["protect", "same"],
        default="protect",
        help="protect (default): lm_head at int8 below 8 bits, kept otherwise; same: like every layer",
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--max-kl", type=float, default=None, help="mixed precision: mean KL budget (nats/token)")
    budget.add_argument("--max-ppl-increase", type=float, default=None, help="mixed precision: perplexity budget (%%)")
    p.add_argument(
        "--candidates", default=None, help="mixed precision candidates, comma-separated (default: FORMAT,int8,fp32)"
    )
    p.add_argument(
        "--sensitivity-samples",
        type=int,
        default=8,
        help="calibration windows used for the mixed-precision sensitivity scan (default 8)",
    )
    p.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--export-gguf", default=None, metavar="FILE", help="also write a GGUF file (GGUF sources only)")
    p.add_argument(
        "--gguf-type", default="q8_0", help="GGUF block type for layers not already in one (q8_0, q4_0, q4_1)"
    )
    add_device_flag(
        p,
        "where the calibration passes, the mixed-precision scan and the quantization run (auto: cuda where torch "
        "sees a GPU); the checkpoint is written from the CPU either way",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def parse_overrides(text: str) -> dict[str, str]:
    """``'lm_head=int8,*.layers.0.*=fp8'`` → ``{"lm_head": "int8", "*.layers.0.*": "fp8"}`` (order kept)."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        pattern, eq, spec = item.partition("=")
        if not eq or not pattern.strip() or not spec.strip():
            raise ConfigError(f"cannot read override {item!r}; write PATTERN=FORMAT, e.g. lm_head=int8")
        out[pattern.strip()] = spec.strip()
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from ..calibrate import CalibrationConfig, calibrate_and_quantize
    from ..eval.corpus import calibration_windows
    from ..kernels.backend import describe
    from ..models.checkpoint import save_quantized
    from ..models.loader import load_model, resolve_model_path
    from ..models.placement import move_model
    from ..models.quantize import QuantizeConfig, quantize
    from ..perf.memory import peak_rss_bytes
    from ..progress import no_progress, rich_progress
    from ._memory import announce, plan_quantize

    device = resolved_device(args.device)
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise ConfigError(f"{out} already exists; choose another --out or pass --overwrite")
    config = QuantizeConfig(
        format=args.format,
        overrides=parse_overrides(args.overrides),
        skip=tuple(filter(None, (s.strip() for s in args.skip.split(",")))),
        output_policy=args.output_policy,
    )
    if args.export_gguf and Path(str(resolve_model_path(args.model))).suffix.lower() != ".gguf":
        raise ConfigError("--export-gguf needs a .gguf source model (its metadata is copied)")
    progress = no_progress if args.no_progress else rich_progress
    plan = announce(  # refuse before loading what the machine cannot hold
        plan_quantize(args.model, config.format, args.calibrate, args.calib_samples, args.calib_len, config.overrides)
    )
    calib = CalibrationConfig(args.calib_samples, args.calib_len, args.calib_corpus, args.seed)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=torch.float32)
    move_model(model, device)
    source = Path(model.source_path)
    windows = None
    mixed = None
    if args.calibrate or args.max_kl is not None or args.max_ppl_increase is not None:
        windows = calibration_windows(tokenizer, calib)
    if args.max_kl is not None or args.max_ppl_increase is not None:
        config, mixed = _mixed(model, windows, config, args, progress)
    if args.calibrate:
        summary = calibrate_and_quantize(model, config, args.calibrate, windows, calib, progress)
    else:
        summary = quantize(model, config)
    config = model.quantize_config
    move_model(model, "cpu")  # written (and exported) from host memory
    tok_source = source if source.suffix.lower() == ".gguf" or source.is_dir() else None
    save_quantized(model, tok_source, out, quantize_config=config, overwrite=args.overwrite)
    gguf_path = None
    if args.export_gguf:
        from ..calibrate.gguf_export import export_gguf

        gguf_path = str(export_gguf(model, source, args.export_gguf, args.gguf_type))
    result = {
        "model": str(source),
        "out": str(out),
        "format": config.format,
        "calibration": config.calibration,
        "overrides": dict(config.overrides),
        "bytes_before": summary.bytes_before,
        "bytes_after": summary.bytes_after,
        "layers": {layer.name: layer.format for layer in summary.layers},
        "skipped": summary.skipped,
        "mixed_precision": mixed,
        "gguf": gguf_path,
        "device": describe(device),
        "seconds": round(time.perf_counter() - t0, 2),
        "memory": {**plan.to_dict(), "measured_peak_bytes": peak_rss_bytes()},
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"quantized {len(summary.layers)} layers of {source.name} to {config.format}"
            f"{' (' + args.calibrate + ')' if args.calibrate else ''}: linear weights "
            f"{summary.bytes_before / 2**20:.1f} MiB → {summary.bytes_after / 2**20:.1f} MiB; saved {out}"
            + (f"; GGUF {gguf_path}" if gguf_path else "")
        )
        if mixed:
            print(f"mixed precision: measured {mixed['measured']}, per unit {mixed['assignment']}", file=sys.stderr)
    return 0


def _mixed(model, windows, config, args, progress):
    from dataclasses import replace

    from ..calibrate.mixed import MixedPrecisionConfig, mixed_precision

    cands = (
        [s.strip() for s in args.candidates.split(",") if s.strip()]
        if args.candidates
        else list(dict.fromkeys([args.format, "int8", "fp32"]))
    )
    mp = MixedPrecisionConfig(candidates=tuple(cands), max_kl=args.max_kl, max_ppl_increase=args.max_ppl_increase)
    res = mixed_precision(model, windows[: args.sensitivity_samples], mp, progress)
    # the user's explicit overrides still win over the chosen ones
    merged = {**dict(config.overrides), **{k: v for k, v in res.config.overrides.items() if k not in config.overrides}}
    return replace(config, format=res.config.format, overrides=merged), res.to_dict()
