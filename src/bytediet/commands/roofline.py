"""``bytediet roofline``: what-if prefill/decode speed, memory fit and binding limit on any hardware."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..config import parse_bytes
from ..errors import ConfigError
from ._parse import positive_ints

_SIMPLE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4, "fp4": 4}


def resolve_weights(spec: str) -> tuple[str, Any]:
    """``4.5`` → 4.5 bits; a registered weight format (``int4-g128``) → the format; else a simple name."""
    try:
        return f"{float(spec):g} bits", float(spec)
    except ValueError:
        pass
    try:
        from ..quant import get_weight_format

        fmt = get_weight_format(spec)
        return fmt.spec(), fmt
    except (KeyError, ValueError):
        pass
    if spec.lower() in _SIMPLE_BITS:
        return spec.lower(), float(_SIMPLE_BITS[spec.lower()])
    raise ConfigError(
        f"unknown weight format {spec!r}: give bits (e.g. 4.5), a registered format, "
        f"or one of {', '.join(_SIMPLE_BITS)}"
    )


def resolve_kv(spec: str) -> tuple[str, Any]:
    """``3.5`` → 3.5 bits per coordinate; a registered KV codec (``turboquant3.5``) → the codec; else a name."""
    try:
        return f"{float(spec):g} bits", float(spec)
    except ValueError:
        pass
    try:
        from ..kvcache import get_kv_codec

        codec = get_kv_codec(spec)
        return codec.describe(), codec
    except (KeyError, ValueError):
        pass
    if spec.lower() in _SIMPLE_BITS:
        return spec.lower(), float(_SIMPLE_BITS[spec.lower()])
    raise ConfigError(
        f"unknown KV format {spec!r}: give bits per coordinate (e.g. 3.5), a registered codec, "
        f"or one of {', '.join(_SIMPLE_BITS)}"
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "roofline", help="predict speed, memory fit and the binding limit on any hardware", description=__doc__
    )
    p.add_argument("--model", default="llama-2-70b", help="catalogue name (llama-2-70b, llama-3-8b, …) or checkpoint")
    p.add_argument("--hardware", default="h100-sxm", help="comma-separated ids, e.g. h100-sxm,h200,tpu-v7,this-machine")
    p.add_argument("--weights", default="fp16", help="weight format: int8 | int4 | fp16 | <bits> | a registered format")
    p.add_argument("--kv", default="bf16", help="KV cache: bf16 | <bits per coordinate> | a registered codec")
    p.add_argument("--batch", default="1,16", help="comma-separated batch sizes (concurrent sequences)")
    p.add_argument("--context", type=int, default=4096, help="tokens in each sequence's cache at decode")
    p.add_argument("--prompt-len", type=int, default=None, help="prefill length L (default: --context)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel chips")
    p.add_argument(
        "--link-bandwidth",
        type=float,
        default=None,
        metavar="GB/S",
        help="the chips' link, bidirectional GB/s (overrides the catalogue; needed for --tp on this-machine)",
    )
    p.add_argument(
        "--link-latency-us",
        type=float,
        default=None,
        metavar="US",
        help="fixed cost of one hop of a ring collective, µs (default: unknown, counted as 0; "
        "bench/tp_step_time.py measures it for gloo on this machine)",
    )
    p.add_argument("--compute", default="auto", help="compute dtype (auto: bf16; fp32 on this-machine)")
    p.add_argument("--json", action="store_true", help="print one JSON object with every number")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a roofline figure")
    p.add_argument("--compare", action="store_true", help="rank the hardware for latency and for throughput")
    p.add_argument("--ops", action="store_true", help="print the per-operator table of every prediction")
    p.add_argument("--measure", action="store_true", help="(re-)measure this machine and add it to --hardware")
    p.add_argument("--dataflow", default=None, metavar="M,K,N", help="GEMM for the dataflow/tiling analysis")
    p.add_argument("--sram", default=None, help="on-chip bytes for --dataflow (default: first device's on-chip memory)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..perf.hardware import get_hardware
    from ..perf.measure import this_machine
    from ..perf.models_catalog import get_model_config
    from ..perf.roofline import analyze, rank_hardware

    ids = [h.strip().lower() for h in args.hardware.split(",") if h.strip()]
    measured = None
    if args.measure:
        measured = this_machine(remeasure=True)
        if "this-machine" not in ids:
            ids.append("this-machine")
    hardware = {i: _with_link(measured if i == "this-machine" and measured else get_hardware(i), args) for i in ids}
    config = get_model_config(args.model)
    w_label, weights = resolve_weights(args.weights)
    kv_label, kv = resolve_kv(args.kv)
    batches = positive_ints(args.batch)
    preds = [
        analyze(
            config,
            hw,
            weights=weights,
            kv=kv,
            batch=b,
            context=args.context,
            prompt_len=args.prompt_len,
            tp=args.tp,
            compute_dtype=args.compute,
        )
        for hw in hardware.values()
        for b in batches
    ]
    result: dict[str, Any] = {
        "model": config.to_dict()
        | {"num_parameters": config.num_parameters, "num_active_parameters": config.num_active_parameters},
        "weights": w_label,
        "kv": kv_label,
        "context": args.context,
        "tp": args.tp,
        "hardware": {i: hw.to_dict() for i, hw in hardware.items()},
        "predictions": [p.to_dict() for p in preds],
    }
    if args.compare:
        result["compare"] = rank_hardware(
            config,
            list(hardware.values()),
            weights=weights,
            kv=kv,
            batches=batches,
            context=args.context,
            prompt_len=args.prompt_len,
            tp=args.tp,
            compute_dtype=args.compute,
        )
    if args.dataflow:
        result["dataflow"] = _dataflow(args, hardware)
    if args.plot:
        from ..perf.plots import plot_roofline

        title = f"{config.name or args.model}: weights {w_label}, KV {kv_label}, context {args.context}"
        result["plot"] = str(plot_roofline(preds, hardware, args.plot, title))
    if args.json:
        print(json.dumps(result, default=float))
    else:
        _print_tables(result, preds, args)
    return 0


def _with_link(hw, args: argparse.Namespace):
    """``hw`` with the link given on the command line (bandwidth in GB/s both directions, latency in µs)."""
    from dataclasses import replace

    for flag, value in (("--link-bandwidth", args.link_bandwidth), ("--link-latency-us", args.link_latency_us)):
        if value is not None and value < 0:
            raise ConfigError(f"{flag} must not be negative, got {value:g}")
    if args.link_bandwidth is not None:
        hw = replace(hw, interconnect_bandwidth=args.link_bandwidth * 1e9)
    if args.link_latency_us is not None:
        hw = replace(hw, interconnect_latency=args.link_latency_us * 1e-6)
    return hw


def _dataflow(args: argparse.Namespace, hardware: dict) -> dict:
    from ..perf.dataflow import analyze_gemm

    m, k, n = positive_ints(args.dataflow) if args.dataflow.count(",") == 2 else (0, 0, 0)
    if not m:
        raise ConfigError(f"--dataflow takes M,K,N (three integers), got {args.dataflow!r}")
    sram = args.sram
    if sram is None:
        first = next(iter(hardware.values()))
        if first.onchip_bytes is None:
            raise ConfigError(f"{first.id} has no on-chip memory size in the catalogue; pass --sram BYTES")
        sram = int(first.onchip_bytes)
    return analyze_gemm(m, n, k, parse_bytes(sram))


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f}"


def _print_tables(result: dict, preds: list, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if Console().is_terminal else 150)
    cfg = result["model"]
    active = cfg.get("num_active_parameters", cfg["num_parameters"])
    moe = f" ({active / 1e9:.2f} B active per token)" if active != cfg["num_parameters"] else ""
    console.print(
        f"[bold]{cfg['name'] or args.model}[/]: {cfg['num_parameters'] / 1e9:.2f} B parameters{moe}, "
        f"weights {result['weights']}, KV {result['kv']}, context {args.context}, tp {args.tp}"
    )
    t = Table(title="roofline prediction (per device, per batch)")
    for col in (
        "hardware",
        "batch",
        "weights GB",
        "KV GB",
        "fits",
        "max batch",
        "chips needed",
        "TTFT ms",
        "TPOT ms",
        "tok/s",
        "decode bound",
        "prefill bound",
    ):
        t.add_column(col, justify="left" if col == "hardware" else "right")
    for p in preds:
        t.add_row(
            p.hardware,
            str(p.batch),
            _gb(p.weights_bytes),
            _gb(p.kv_bytes),
            "yes" if p.fits else "no",
            str(p.max_batch),
            str(p.chips_to_hold),
            f"{p.ttft_s * 1e3:,.1f}",
            f"{p.time_per_output_token_s * 1e3:,.2f}",
            f"{p.decode_tokens_per_s:,.1f}",
            p.decode.bound,
            p.prefill.bound,
        )
    console.print(t)
    for p in preds if args.ops else preds[:1]:
        ops = Table(title=f"decode operators: {p.hardware}, batch {p.batch} ({p.compute_dtype} compute)")
        for col in ("operator", "GFLOP", "MB moved", "FLOP/byte", "time ms", "bound"):
            ops.add_column(col, justify="left" if col == "operator" else "right")
        for o in p.decode.ops:
            ops.add_row(
                o.name,
                f"{o.flops / 1e9:,.2f}",
                f"{o.bytes / 1e6:,.1f}",
                f"{o.intensity:,.2f}",
                f"{o.time * 1e3:,.3f}",
                o.bound,
            )
        if p.decode.allreduce_s:
            ops.add_row(
                "collectives (of which latency)",
                "",
                "",
                "",
                f"{p.decode.allreduce_s * 1e3:,.3f} ({p.decode.allreduce_latency_s * 1e3:,.3f})",
                "interconnect",
            )
        console.print(ops)
    if "compare" in result:
        c = Table(title="hardware portfolio (fewest chips that hold the model)")
        for col in ("hardware", "chips", "TPOT ms @1", "best batch", "tok/s", "tok/s per chip", "bound"):
            c.add_column(col, justify="left" if col == "hardware" else "right")
        for r in sorted(result["compare"]["rows"], key=lambda r: r.get("time_per_output_token_s", float("inf"))):
            if not r["fits"]:
                c.add_row(r["hardware"], str(r["chips"]), r["reason"], "", "", "", "")
                continue
            c.add_row(
                r["hardware"],
                str(r["chips"]),
                f"{r['time_per_output_token_s'] * 1e3:,.2f}",
                str(r["best_batch"]),
                f"{r['throughput_tokens_per_s']:,.0f}",
                f"{r['throughput_per_chip']:,.1f}",
                r["throughput_bound"],
            )
        console.print(c)
        console.print("latency (batch-1 decode): " + " > ".join(result["compare"]["latency_ranking"]))
        console.print("throughput per chip:      " + " > ".join(result["compare"]["throughput_ranking"]))
    if "dataflow" in result:
        d = result["dataflow"]
        df = Table(title=f"GEMM {d['m']}x{d['k']} · {d['k']}x{d['n']}, on-chip {d['sram_bytes'] / 1e6:,.3f} MB")
        for col in ("dataflow", "tile (Tm,Tn,Tk)", "A MB", "B MB", "C MB", "total MB", "FLOP/byte"):
            df.add_column(col, justify="left" if col == "dataflow" else "right")
        for name, r in d["dataflows"].items():
            if r is None:
                df.add_row(name, "does not fit", "", "", "", "", "")
                continue
            df.add_row(
                name,
                str(tuple(r["tile"])),
                f"{r['bytes_a'] / 1e6:,.2f}",
                f"{r['bytes_b'] / 1e6:,.2f}",
                f"{r['bytes_c'] / 1e6:,.2f}",
                f"{r['total_bytes'] / 1e6:,.2f}",
                f"{r['intensity']:,.1f}",
            )
        console.print(df)
        console.print(
            f"best: {d['best']}; lower bound {d['lower_bound_bytes'] / 1e6:,.2f} MB "
            f"(compulsory {d['compulsory_bytes'] / 1e6:,.2f} MB)"
        )
    if "plot" in result:
        console.print(f"wrote {result['plot']}")
