"""``bytediet bench``: bytediet side by side with llama.cpp and transformers, and the roofline check."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from ..errors import ConfigError
from ._engine_args import add_device_args, resolved_device
from ._parse import positive_ints


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark bytediet against llama.cpp and transformers",
        description="Single-stream prefill/decode, a concurrency sweep (throughput, TTFT, TPOT "
        "p50/p99) for bytediet and its peers on the same GGUF, and the roofline's "
        "predicted vs measured decode speed.",
    )
    p.add_argument("--model", default="default", help="GGUF file, Hugging Face directory, or 'default' / 'gemma3-270m'")
    p.add_argument(
        "--threads", type=int, default=2, help="torch threads (bytediet, transformers) and llama.cpp n_threads"
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="run bytediet split across N processes (each loads its own shard and gets --threads // N "
        "threads, at least 1); every part runs, the roofline predicts for N ranks",
    )
    p.add_argument(
        "--peers",
        default="llama.cpp,transformers",
        help="comma-separated peers (llama.cpp, llama-server, transformers), or 'none'; llama.cpp's "
        "concurrency sweep runs on llama-server when bench/build_llama_server.sh has built it",
    )
    p.add_argument("--concurrency", default=None, help="concurrent requests per level (default 1,4,16,32,64)")
    p.add_argument(
        "--roofline-batches", default=None, help="batch sizes of the predicted-vs-measured check (default 1,16)"
    )
    p.add_argument(
        "--roofline-context",
        type=int,
        default=None,
        metavar="N",
        help="prompt tokens before the roofline check's decode steps (default 64): its context",
    )
    p.add_argument(
        "--prompt-lens", default=None, metavar="LO,HI", help="prompt length range of the sweep (default 64,512)"
    )
    p.add_argument(
        "--output-lens", default=None, metavar="LO,HI", help="output length range of the sweep (default 32,128)"
    )
    p.add_argument(
        "--requests-per-level",
        type=int,
        default=None,
        help="requests per concurrency level: max(level, this) (default 4)",
    )
    p.add_argument(
        "--parts",
        default="single,concurrency,roofline",
        help="which parts to run (comma-separated): single, concurrency, roofline, context, prefix-cache "
        "(KV tiers: a repeated long prompt cold / RAM hit / disk hit, and a multi-turn chat); or "
        "speculative on its own (batch-1 decode with and without --speculative-config on copy-heavy "
        "and open prompts, beside llama.cpp's prompt-lookup decoding)",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='the speculative part\'s config (default {"method": "ngram", "num_speculative_tokens": 4})',
    )
    p.add_argument("--spec-max-tokens", type=int, default=128, help="speculative part: tokens decoded per prompt")
    p.add_argument(
        "--spec-rounds",
        type=int,
        default=3,
        help="speculative part: rounds over the prompts, every system interleaved prompt by prompt",
    )
    p.add_argument(
        "--contexts",
        default=None,
        metavar="N,N,...",
        help="context part: contexts (tokens) each batch-1 decode run ends at (default 512,2048,8192)",
    )
    p.add_argument(
        "--prefix-prompt-len",
        type=int,
        default=None,
        metavar="N",
        help="prefix-cache part: tokens of the repeated prompt (default 8192)",
    )
    p.add_argument(
        "--kv-offload-size",
        default=None,
        metavar="SIZE",
        help="prefix-cache part: the KV tiers' host-RAM size (default 4GiB)",
    )
    p.add_argument(
        "--weights",
        default=None,
        metavar="FMT",
        help="bytediet weight format (e.g. int8, int4-g64, fp32); default: the GGUF's native blocks",
    )
    p.add_argument(
        "--formats",
        default=None,
        metavar="FMT[:KV],...",
        help="also run the single-stream and context parts with these weight formats of the same model "
        "('gguf' = the native blocks; ':KV' also sets the KV codec, e.g. gguf:int8), in the same "
        "run: the bytes-vs-speed table of every format",
    )
    p.add_argument(
        "--activations",
        default="q16",
        choices=["q16", "q8", "f32"],
        help="how native GGUF blocks multiply (int8 or float activations)",
    )
    p.add_argument("--kv-cache-dtype", default="auto", metavar="CODEC", help="bytediet KV-cache codec")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="bytediet token budget per step",
    )
    p.add_argument("--measure", action="store_true", help="re-measure this machine's bandwidth before the run")
    p.add_argument("--quick", action="store_true", help="tiny workloads (seconds; for tests and CI)")
    add_device_args(p)
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="with --parts concurrency: TTFT / TPOT percentiles and throughput against concurrency, every system",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--out", default=None, metavar="FILE.json", help="also write the JSON here")
    p.set_defaults(handler=run)


def bench_config(args: argparse.Namespace):
    from ..perf.bench import BenchConfig

    if args.threads < 1:
        raise ConfigError("--threads must be at least 1")
    if args.tensor_parallel_size < 1:
        raise ConfigError(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}")
    overrides: dict[str, Any] = {"threads": args.threads}
    if args.concurrency:
        overrides["concurrency"] = positive_ints(args.concurrency, "--concurrency")
    if args.roofline_batches:
        overrides["roofline_batches"] = positive_ints(args.roofline_batches, "--roofline-batches")
    for flag, key in (("prompt_lens", "prompt_len_range"), ("output_lens", "output_len_range")):
        value = getattr(args, flag)
        if value:
            pair = positive_ints(value, "--" + flag.replace("_", "-"))
            if len(pair) != 2:
                raise ConfigError(f"--{flag.replace('_', '-')}: give LO,HI, got {value!r}")
            overrides[key] = pair
    if args.requests_per_level is not None:
        overrides["min_requests"] = args.requests_per_level
    if args.roofline_context is not None:
        overrides["roofline_prompt_len"] = args.roofline_context
    if args.contexts:
        overrides["contexts"] = positive_ints(args.contexts, "--contexts")
    if args.prefix_prompt_len is not None:
        overrides["prefix_prompt_len"] = args.prefix_prompt_len
    if args.kv_offload_size is not None:
        overrides["prefix_offload_size"] = args.kv_offload_size
    return BenchConfig.quick(**overrides) if args.quick else BenchConfig(**overrides)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..perf.bench import PARTS
    from ..perf.measure import this_machine

    config = bench_config(args)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if parts == ["speculative"]:
        return run_speculative(args, config)
    if not parts or set(parts) - set(PARTS):
        raise ConfigError(f"--parts: choose from {', '.join(PARTS)} (or speculative on its own), got {args.parts!r}")
    if args.weights:
        from ..quant import get_weight_format

        check_splits(get_weight_format(args.weights), "--weights", args.tensor_parallel_size)
    progress = lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)
    variants = [LazyVariant(spec, args, config, progress) for spec in _formats(args)]
    torch.set_num_threads(config.threads)
    args.device = bench_device(args)
    if args.device == "cuda":  # the GPU's own ceilings: the roofline predicts for it
        from ..perf.measure_gpu import this_gpu

        hardware = this_gpu(remeasure=args.measure)
    else:
        hardware = this_machine(measure_if_missing=True, threads=config.threads, remeasure=args.measure)
    tp = args.tensor_parallel_size
    progress(
        f"loading {args.model}"
        + (f" with weights {args.weights}" if args.weights else "")
        + (f" across {tp} processes" if tp > 1 else "")
    )
    ours = load_system(args, config.threads, args.weights, args.kv_cache_dtype)
    try:
        return _run(args, config, parts, ours, variants, hardware, progress)
    finally:  # tensor parallel: stop the ranks, also when a part failed
        for system in (*variants, ours):
            system.close()


def run_speculative(args: argparse.Namespace, config) -> int:
    """``--parts speculative``: one JSON object (``--json``) or a table of decode tok/s per task and system."""
    from ..engine.speculative import SpeculativeConfig
    from ..eval.corpus import novel_text
    from ..perf.speculative_bench import run_speculative_bench

    if args.spec_rounds < 1:
        raise ConfigError(f"--spec-rounds must be at least 1, got {args.spec_rounds}")
    spec = SpeculativeConfig.parse(args.speculative_config or '{"method": "ngram", "num_speculative_tokens": 4}')
    names = [] if args.peers.strip().lower() in ("", "none") else [n.strip() for n in args.peers.split(",")]
    progress = lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)
    result = run_speculative_bench(
        args.model,
        spec.to_dict(),
        threads=config.threads,
        max_tokens=16 if args.quick else args.spec_max_tokens,
        text=novel_text("persuasion"),
        peers=names,
        rounds=1 if args.quick else args.spec_rounds,
        per_task=1 if args.quick else 3,
        progress=progress,
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
        return 0
    tasks = list(result["systems"]["bytediet"])
    print("decode tok/s   " + "".join(f"{t:>10}" for t in tasks))
    for name, rows in result["systems"].items():
        cells = "".join(f"{_f(rows[t]['decode_tokens_per_s']):>10}" if t in rows else f"{'—':>10}" for t in tasks)
        print(f"{name:15s}{cells}")
    for name, r in result["ratios"].items():
        print(f"bytediet+spec / {name:17s}" + "".join(f"{_f(r[t], '.2f'):>9}×" for t in tasks))
    lookup = result.get("prompt_lookup", {})
    for key, label in (("ceiling", "lookup ceiling (free rows)"), ("predicted", "lookup predicted (row cost)")):
        if any(key in lookup.get(t, {}) for t in tasks):
            print(f"{label:32s}" + "".join(f"{_f(lookup.get(t, {}).get(key), '.2f'):>9}×" for t in tasks))
    return 0


def bench_device(args: argparse.Namespace) -> str:
    """--device resolved (auto: cuda where torch sees a GPU; tensor parallelism stays on the CPU)."""
    return resolved_device(args.device, args.tensor_parallel_size)


def load_system(args: argparse.Namespace, threads: int, weights, kv_cache_dtype: str):
    """bytediet's system for ``weights``: the model loaded in this process, or split across
    ``--tensor-parallel-size`` processes that each load their own shard."""
    import torch

    from ..models.loader import load_model
    from ..perf.peers import BytedietSystem

    common = dict(kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=args.max_num_batched_tokens)
    if args.tensor_parallel_size > 1:
        return BytedietSystem.tensor_parallel(
            args.model,
            args.tensor_parallel_size,
            threads=threads,
            weights=weights,
            activations=args.activations,
            **common,
        )
    device = getattr(args, "device", "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the GPU computes in bf16, the CPU in float32
    loaded = load_model(args.model, dtype=dtype, weights=weights, keep_packed=True, activations=args.activations)
    system = BytedietSystem(
        loaded, threads=threads, device=device, enforce_eager=getattr(args, "enforce_eager", False), **common
    )
    if kv_cache_dtype.strip().lower().startswith("auto:"):  # a byte budget: planned as generate/serve plan it
        from ..eval.harness import calibrated_kv_codec
        from ._engine_args import KV_CALIBRATION

        codec = calibrated_kv_codec(kv_cache_dtype, *loaded, dict(KV_CALIBRATION))
        system.kv_cache_dtype, system.kv_state = codec.name, codec.calibration_state()
    return system


def _run(args: argparse.Namespace, config, parts: list[str], ours, variants: list, hardware, progress) -> int:
    from ..eval.corpus import corpus_token_ids
    from ..models.loader import resolve_model_path
    from ..perf.bench import run_bench
    from ..perf.peers import make_peers

    model, tokenizer = ours.model, ours.tokenizer
    names = (
        [] if args.peers.strip().lower() in ("", "none") else [n.strip() for n in args.peers.split(",") if n.strip()]
    )
    path = resolve_model_path(args.model)
    eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or [0])
    if names:
        progress(f"loading peers: {', '.join(names)}")
    n_ctx = 256 * -(-(config.longest_sequence(parts) + 16) // 256)
    peers = make_peers(names, path, threads=config.threads, n_ctx=n_ctx, pad_token_id=eos[0], device=args.device)
    extra = {"command": command_line(args), "model": str(path)}

    def write(partial: dict) -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({**partial, **extra}, indent=2) + "\n")

    corpus = corpus_token_ids(tokenizer, model.config.vocab_size, config.corpus_tokens(parts), config.seed)
    result = {
        **run_bench(
            ours,
            peers,
            config,
            parts=parts,
            hardware=hardware,
            progress=progress,
            checkpoint=write,
            corpus=corpus,
            variants=variants,
        ),
        **extra,
    }
    if args.plot and "concurrency" in parts:
        from ..perf.plots import concurrency_series, plot_concurrency

        series = concurrency_series(result["systems"])
        result["plot"] = str(plot_concurrency(series, args.plot, f"{Path(str(path)).name}: concurrency sweep"))
    write(result)
    if args.json:
        print(json.dumps(result))
    else:
        print_tables(result)
    return 0


def _formats(args: argparse.Namespace) -> list[str]:
    """--formats entries, each ``weights`` or ``weights:kv``, checked against the registries."""
    if not args.formats:
        return []
    specs = [f.strip() for f in args.formats.split(",") if f.strip()]
    from ..kvcache import get_kv_codec
    from ..quant import get_weight_format

    for spec in specs:
        weights, _, kv = spec.partition(":")
        try:
            if weights != "gguf":
                check_splits(get_weight_format(weights), "--formats", args.tensor_parallel_size)
            if kv:
                get_kv_codec(kv)
        except KeyError as exc:
            raise ConfigError(f"--formats: {exc.args[0]}") from None
    return specs


def check_splits(fmt, flag: str, tp: int) -> None:
    """Refuse, before anything loads, a weight format that cannot be cut into tensor-parallel shards (one that
    keeps :class:`~bytediet.quant.base.WeightFormat`'s refusing ``shard``)."""
    from ..quant.base import WeightFormat

    if tp > 1 and type(fmt).shard is WeightFormat.shard:
        raise ConfigError(
            f"{flag} {fmt.spec()}: this weight format cannot be split for tensor parallelism "
            f"(--tensor-parallel-size {tp}); drop it, use a format that splits (fp32, bf16, fp16, "
            "int8, GGUF blocks) or --tensor-parallel-size 1"
        )


class LazyVariant:
    """A bytediet system for one more weight format of the benchmarked model, loaded when it runs (and
    dropped after), so only one extra model is in memory at a time."""

    def __init__(self, spec: str, args: argparse.Namespace, config, progress) -> None:
        self.name = f"bytediet {spec}"
        self.spec, self.args, self.config, self.progress, self._system = spec, args, config, progress, None

    def _load(self):
        if self._system is None:
            spec, _, kv = self.spec.partition(":")
            self.progress(f"loading {self.args.model} with weights {spec}" + (f", KV {kv}" if kv else ""))
            self._system = load_system(
                self.args, self.config.threads, None if spec == "gguf" else spec, kv or self.args.kv_cache_dtype
            )
        return self._system

    def info(self) -> dict:
        return self._load().info()

    def serve(self, prompts, max_tokens, concurrency):
        return self._load().serve(prompts, max_tokens, concurrency)

    def close(self) -> None:
        if self._system is not None:
            self._system.close()  # tensor parallel: its ranks stop
        self._system = None


def command_line(args: argparse.Namespace) -> str:
    """The flags of this run, spelled out (defaults included), to reproduce it."""
    flags = [
        f"--model {args.model}",
        f"--threads {args.threads}",
        f"--peers {args.peers}",
        f"--parts {args.parts}",
        f"--kv-cache-dtype {args.kv_cache_dtype}",
        f"--max-num-batched-tokens {args.max_num_batched_tokens}",
    ]
    if args.tensor_parallel_size > 1:
        flags.append(f"--tensor-parallel-size {args.tensor_parallel_size}")
    if getattr(args, "device", "cpu") != "cpu":
        flags.append(f"--device {args.device}" + (" --enforce-eager" if args.enforce_eager else ""))
    for flag, value in (
        ("--weights", args.weights),
        ("--formats", args.formats),
        ("--contexts", args.contexts),
        ("--activations", args.activations),
        ("--concurrency", args.concurrency),
        ("--roofline-batches", args.roofline_batches),
        ("--roofline-context", args.roofline_context),
        ("--prompt-lens", args.prompt_lens),
        ("--output-lens", args.output_lens),
        ("--requests-per-level", args.requests_per_level),
        ("--prefix-prompt-len", args.prefix_prompt_len),
        ("--kv-offload-size", args.kv_offload_size),
    ):
        if value:
            flags.append(f"{flag} {value}")
    return " ".join(["bytediet bench", *flags, *(["--quick"] if args.quick else [])])


def _f(value, spec: str = ".1f", scale: float = 1.0) -> str:
    return "—" if value is None else format(value * scale, spec)


def print_tables(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)  # files and pipes: no wrapping at 80 columns
    m = r["machine"]
    tp = r.get("tensor_parallel_size", 1)
    split = f" (bytediet across {tp} processes, {max(1, r['config']['threads'] // tp)} each)" if tp > 1 else ""
    console.print(
        f"[bold]{r.get('model')}[/] on {m['cpu']} ({m['cores']} cores), {r['config']['threads']} threads{split}, "
        f"load average {m['load_average'][0]:.2f} → {m['load_average_end'][0]:.2f}; measured read bandwidth "
        f"{_f(r['read_bandwidth_gb_per_s'])} GB/s; prompts from {r['corpus']}"
    )
    systems = {k: v for k, v in r["systems"].items() if v["available"]}
    for name, s in r["systems"].items():
        if not s["available"]:
            console.print(f"[yellow]{name}: {s['reason']}[/]")
    c = r["config"]
    if any("single" in s for s in systems.values()):
        t = Table(
            title=f"single stream: prefill of {c['prefill_len']} tokens; {c['decode_new_tokens']} decode "
            f"tokens after {c['decode_prompt_len']}"
        )
        for col in ("system", "weights", "prefill tok/s", "decode tok/s", "weight MB", "achieved GB/s", "% read BW"):
            t.add_column(col, justify="left" if col in ("system", "weights") else "right")
        for name, s in systems.items():
            one = s["single"]
            t.add_row(
                name,
                s["info"]["weights"],
                _f(one["prefill_tokens_per_s"]),
                _f(one["decode_tokens_per_s"]),
                _f(s["info"].get("weight_bytes"), ".0f", 1e-6),
                _f(one.get("achieved_weight_gb_per_s"), ".2f"),
                _f(one.get("fraction_of_read_bandwidth"), ".0f", 100),
            )
        console.print(t)
    if any("concurrency" in s for s in systems.values()):
        t = Table(title="concurrency sweep (all requests arrive at t=0; times in ms)")
        for col in ("concurrency", "system", "requests", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"):
            t.add_column(col, justify="left" if col == "system" else "right")
        for level in map(str, c["concurrency"]):
            for name, s in systems.items():
                q = s.get("concurrency", {}).get(level)
                ran = s.get("concurrency_system", {}).get("system")
                label = name if ran in (None, name) else f"{name} ({ran})"
                if q:
                    t.add_row(
                        level,
                        label,
                        str(q["requests"]),
                        _f(q["output_tokens_per_s"]),
                        *(_f(q[k], ".0f", 1e3) for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")),
                    )
        console.print(t)
    _print_ratios(console, r)
    if "roofline" in r:
        _print_roofline(console, r["roofline"])
    _print_formats(console, r)
    if "context_roofline" in r:
        _print_context(console, r)
    if "prefix_cache" in r:
        _print_prefix_cache(console, r["prefix_cache"])


def _print_prefix_cache(console, pc: dict) -> None:
    from rich.table import Table

    if "skipped" in pc:
        console.print(f"[yellow]prefix-cache: {pc['skipped']}[/]")
        return
    rp = pc["repeated_prompt"]
    t = Table(title=f"KV tiers: a {rp['prompt_tokens']}-token prompt again (pool of {rp['pool_blocks']} blocks)")
    for col in ("run", "TTFT ms", "× cold", "cached tokens", "tokens = cold"):
        t.add_column(col, justify="left" if col in ("run", "cached tokens") else "right")
    for name in ("cold", "ram_hit", "disk_hit"):
        x = rp[name]
        t.add_row(
            name,
            _f(x["ttft_s"], ".0f", 1e3),
            _f(x["ttft_s"] / rp["cold"]["ttft_s"], ".2f"),
            str(x["cached_tokens"]),
            str(x["tokens_equal_cold"]),
        )
    console.print(t)
    ch = pc["multi_turn_chat"]
    t = Table(
        title=f"KV tiers: multi-turn chat, {ch['conversations']} conversations over {ch['system_prompts']} "
        f"system prompts of {ch['system_tokens']} tokens (pool {ch['pool_blocks']} blocks)"
    )
    for col in ("tiers", "TTFT mean ms", "TTFT p50 ms", "out tok/s"):
        t.add_column(col, justify="left" if col == "tiers" else "right")
    for name in ("tiers_off", "tiers_on"):
        x = ch[name]
        t.add_row(
            name, _f(x["ttft_mean_s"], ".0f", 1e3), _f(x["ttft_p50_s"], ".0f", 1e3), _f(x["output_tokens_per_s"], ".1f")
        )
    console.print(t)


def _print_formats(console, r: dict) -> None:
    """Bytes against speed for every bytediet weight format of the run (needs --formats)."""
    from rich.table import Table

    mine = {n: s for n, s in r["systems"].items() if n.startswith("bytediet") and s.get("available") and "single" in s}
    if len(mine) < 2:
        return
    peers = list(r["ratios"])
    t = Table(title="bytes down ⇒ time down: batch-1 decode of every weight format (same run)")
    for col in (
        "system",
        "weights",
        "weight MB",
        "decode tok/s",
        "prefill tok/s",
        "achieved GB/s",
        *(f"vs {p}" for p in peers),
    ):
        t.add_column(col, justify="left" if col in ("system", "weights") else "right")
    for name, s in sorted(mine.items(), key=lambda kv: -(kv[1]["info"].get("weight_bytes") or 0)):
        one = s["single"]
        cells = []
        for p in peers:
            ratio = r["ratios"][p] if name == "bytediet" else r["ratios"][p].get(name, {})
            cells.append(_f(ratio.get("decode_tokens_per_s"), ".2f"))
        t.add_row(
            name,
            s["info"]["weights"],
            _f(s["info"].get("weight_bytes"), ".0f", 1e-6),
            _f(one["decode_tokens_per_s"]),
            _f(one["prefill_tokens_per_s"]),
            _f(one.get("achieved_weight_gb_per_s"), ".2f"),
            *cells,
        )
    console.print(t)


def _print_context(console, r: dict) -> None:
    """Batch-1 decode speed at each context, every system, and the roofline's prediction for bytediet."""
    from rich.table import Table

    systems = {n: s for n, s in r["systems"].items() if s.get("available") and "context" in s}
    pred = {row["context"]: row for row in r["context_roofline"]}
    t = Table(
        title=f"context scaling: batch-1 decode of {r['config']['context_new_tokens']} tokens ending at each "
        f"context (tok/s)"
    )
    t.add_column("context", justify="right")
    for name in systems:
        t.add_column(name, justify="right")
    peers = [p for p in r["ratios"] if p in systems]
    for p in peers:
        t.add_column(f"bytediet / {p}", justify="right")
    for col in ("roofline step ms", "bytediet step ms", "KV MB/step"):
        t.add_column(col, justify="right")
    for n in map(str, r["config"]["contexts"]):
        row = pred.get(int(n), {})
        t.add_row(
            n,
            *(_f(s["context"].get(n, {}).get("decode_tokens_per_s")) for s in systems.values()),
            *(_f(r["ratios"][p].get(f"context_{n}"), ".2f") for p in peers),
            _f(row.get("predicted_step_s"), ".1f", 1e3),
            _f(row.get("measured_step_s"), ".1f", 1e3),
            _f(row.get("kv_bytes_per_step"), ".0f", 1e-6),
        )
    console.print(t)


def _print_ratios(console, r: dict) -> None:
    from rich.table import Table

    if not r["ratios"]:
        return
    t = Table(title="bytediet / peer (tok/s: > 1 is bytediet faster; TTFT, TPOT: < 1 is bytediet faster)")
    t.add_column("metric")
    for peer in r["ratios"]:
        t.add_column(peer, justify="right")
    keys = ["prefill_tokens_per_s", "decode_tokens_per_s"]
    keys += [f"concurrency_{c}" for c in r["config"]["concurrency"]]
    for key in keys:
        cells = [r["ratios"][p].get(key) for p in r["ratios"]]
        if all(v is None for v in cells):
            continue
        if key.startswith("concurrency_"):
            for sub in ("output_tokens_per_s", "ttft_p50_s", "tpot_p50_s"):
                t.add_row(f"{key} {sub}", *(_f(v.get(sub) if v else None, ".2f") for v in cells))
        else:
            t.add_row(key, *(_f(v, ".2f") for v in cells))
    console.print(t)


def _print_roofline(console, rf: dict) -> None:
    from rich.table import Table

    t = Table(
        title=f"roofline ({rf['hardware_name']}): predicted vs measured bytediet decode, weights "
        f"{rf['weights']}, KV {rf['kv']}"
    )
    for col in (
        "measurement",
        "batch",
        "context",
        "predicted tok/s",
        "measured tok/s",
        "measured/predicted",
        "bound",
        "step ms pred",
        "step ms meas",
        "linears ms",
        "forward ms",
        "engine ms",
        "achieved GB/s",
    ):
        t.add_column(col, justify="left" if col == "measurement" else "right")
    for row in rf["rows"]:
        t.add_row(
            row["measurement"],
            str(row["batch"]),
            str(row["context"]),
            _f(row["predicted_tokens_per_s"]),
            _f(row["measured_tokens_per_s"]),
            _f(row["measured_over_predicted"], ".2f"),
            row["predicted_bound"],
            _f(row["predicted_step_s"], ".1f", 1e3),
            _f(row["measured_step_s"], ".1f", 1e3),
            _f(row.get("linear_pass_s"), ".1f", 1e3),
            _f(row.get("forward_s_per_step"), ".1f", 1e3),
            _f(row.get("overhead_s_per_step"), ".1f", 1e3),
            _f(row["achieved_bandwidth"], ".2f", 1e-9),
        )
    console.print(t)
