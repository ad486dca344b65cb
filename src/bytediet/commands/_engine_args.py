"""Flags shared by every command that runs the engine (generate, chat, serve, bench, eval)."""

from __future__ import annotations

import argparse

from ..config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from ..engine.params import SamplingParams

# How a KV budget (auto:<bits>) is planned unless --kv-calib-* say otherwise; bench plans its budgets this way too.
KV_CALIBRATION = {"corpus": "prideprejudice", "windows": 1, "window_len": 512, "seed": 0}


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and memory")
    g.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="run config JSON (e.g. the recommended.json of `bytediet optimize`): it sets the model, "
        "weights, KV codec and engine settings; --threads still applies",
    )
    g.add_argument(
        "--model",
        default="default",
        help="GGUF file, Hugging Face directory, saved bytediet directory, or 'default' / 'gemma3-270m'",
    )
    g.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="compute dtype (float32 is fastest on CPUs without bf16 matmul units)",
    )
    g.add_argument(
        "--weights", default=None, metavar="FORMAT", help="re-quantize weights at load time (e.g. int8, int4-g128)"
    )
    g.add_argument(
        "--keep-packed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run GGUF-quantized weights on their native blocks (default); --no-keep-packed or "
        "--weights fp32 dequantizes them (the exact reference)",
    )
    g.add_argument(
        "--activations",
        default="q16",
        choices=["q16", "q8", "f32"],
        help="how native GGUF blocks multiply: q16 (default) as two int8 planes per activation block "
        "(int16-like precision), q8 as one (llama.cpp's method: fastest, a measured accuracy cost, "
        "see bench/RESULTS.md), f32 with float activations",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        metavar="CODEC",
        help="KV-cache codec (auto, fp32, bf16, int8, q8_0, k=q8_0,v=q4_0, turboquant3.5, ...) or a budget "
        "auto:<bits> (e.g. auto:4.5): per layer and for K and V, the codecs of least measured "
        "attention error within that many bits per coordinate all-in, chosen by a calibration pass",
    )
    g.add_argument(
        "--kv-calib-windows",
        type=int,
        default=KV_CALIBRATION["windows"],
        metavar="N",
        help=f"calibration windows (corpus calibration split) for a KV budget (default {KV_CALIBRATION['windows']})",
    )
    g.add_argument(
        "--kv-calib-len",
        type=int,
        default=KV_CALIBRATION["window_len"],
        help=f"tokens per KV calibration window (default {KV_CALIBRATION['window_len']})",
    )
    g.add_argument(
        "--save-config",
        default=None,
        metavar="FILE",
        help="write what ran as a run config (model, weights, KV codec with its calibration state or "
        "plan, engine settings), reusable with --config",
    )
    g.add_argument(
        "--kv-calib-corpus",
        default=KV_CALIBRATION["corpus"],
        help=f"corpus of the KV calibration (default {KV_CALIBRATION['corpus']})",
    )
    g.add_argument(
        "--kv-cache-memory",
        default=None,
        help="memory budget of the KV cache (e.g. 512MiB, 2GiB; default 1GiB on the CPU, on CUDA what "
        "--gpu-memory-utilization leaves free)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV block (default 16, or the codec's minimum if larger: kivi's group of 32)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help=f"token budget per engine step (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    g.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        metavar="N",
        help="most prompt tokens one request computes per step (0: no cap beyond the budget)",
    )
    g.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="fcfs: arrival order; priority: requests' integer priority, smaller first, then arrival",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s JSON shape: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (prompt lookup; docs/speculative.md)',
    )
    t = p.add_argument_group("KV tiers (docs/kv-tiers.md)")
    t.add_argument(
        "--kv-offload-size",
        default="0",
        metavar="SIZE",
        help="host-RAM tier for prefix-cache blocks evicted from the KV pool, e.g. 4GiB (default 0: none)",
    )
    t.add_argument(
        "--kv-offload-dir",
        default=None,
        metavar="DIR",
        help="disk tier: keep evicted prefix-cache blocks in DIR, found again after a restart",
    )
    t.add_argument(
        "--kv-offload-disk-size",
        default="40GiB",
        metavar="SIZE",
        help="most bytes the disk tier keeps in --kv-offload-dir (LRU; default 40GiB)",
    )
    t.add_argument(
        "--kv-offload-codec",
        default=None,
        metavar="CODEC",
        help="re-encode offloaded blocks with this smaller KV codec (e.g. rot-q8_0 under a bf16 pool); "
        "default: the pool's own pages, bit for bit",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice; per process with --tensor-parallel-size)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split the model across N processes (Megatron-style; gloo on CPU, NCCL on CUDA); "
        "each process gets the CPU cores / N threads unless --threads is given",
    )
    add_device_args(p)


def add_device_args(p: argparse.ArgumentParser) -> None:
    """``--device`` and the GPU's settings (every command that runs a model takes them)."""
    g = p.add_argument_group("device")
    add_device_flag(
        g,
        "where the model, KV cache and sampling run (auto: cuda where torch sees a GPU); on cuda "
        "every linear and the paged attention run Triton kernels (docs/gpu.md)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="F",
        help="share of the GPU's memory the engine may fill; the KV cache gets what the weights and "
        "activations leave (default 0.9)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run decode steps eagerly on cuda (default: replay CUDA graphs per batch-size bucket)",
    )


def add_device_flag(p, help: str) -> None:
    """``--device auto|cpu|cuda`` alone (eval and quantize take it without the engine's GPU settings)."""
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help=help)


def resolved_device(device: str, tensor_parallel_size: int = 1) -> str:
    """``--device`` resolved as the engine resolves it (auto: cuda where torch sees a GPU for every rank);
    ``cuda`` without a GPU, or with fewer GPUs than ``--tensor-parallel-size``, is refused in one line."""
    from ..engine.device import resolve_device

    return resolve_device(device, tensor_parallel_size)


def device_kwargs(args: argparse.Namespace) -> dict:
    """The LLM keyword arguments of :func:`add_device_args`' flags."""
    return {
        "device": args.device,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": args.enforce_eager,
    }


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None, help="return top-N logprobs per token")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )


def build_llm(args: argparse.Namespace):
    from ..engine.llm import LLM

    if getattr(args, "config", None):
        from ..optimize.run_config import load_run_config

        kwargs = {**load_run_config(args.config), **device_kwargs(args)}
        if args.threads:
            kwargs["num_threads"] = args.threads
        if args.tensor_parallel_size > 1:
            kwargs["tensor_parallel_size"] = args.tensor_parallel_size
        return LLM(**kwargs, **offload_kwargs(args))
    kv_kwargs = {"kv_cache_dtype": args.kv_cache_dtype}
    if args.kv_cache_dtype.strip().lower().startswith("auto:") or (
        args.kv_calib_windows > 0 and _needs_calibration(args.kv_cache_dtype)
    ):
        kv_kwargs = plan_kv_budget_for(args)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        weights=args.weights,
        keep_packed=args.keep_packed,
        activations=args.activations,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        scheduling_policy=args.scheduling_policy,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.threads,
        **kv_kwargs,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
        **device_kwargs(args),
        **offload_kwargs(args),
    )
    if getattr(args, "save_config", None):
        save_run_config(llm, args)
    seed_tier_policy(llm)
    seed_speculation_limit(llm)
    return llm


def measured_hardware(llm):
    """This machine's measured ceilings (``perf.measure.this_machine``) at the engine's thread count, or None when
    the machine has not been measured (the roofline seeds below then leave the engine's defaults)."""
    from ..errors import BytedietError
    from ..perf.measure import this_machine

    try:
        return this_machine(measure_if_missing=False, threads=llm.config.num_threads or 2)
    except BytedietError:
        return None


def seed_speculation_limit(llm) -> None:
    """Speculative decoding without ``disable_by_batch_size``: speculate in batches whose verifying step (1 + k rows
    per sequence) stays memory-bound on this machine's roofline (skipped off the CPU, or when the machine has not been
    measured: the engine's default stands)."""
    spec = llm.config.speculative
    if spec is None or spec.disable_by_batch_size is not None or llm.model.device.type != "cpu":
        return
    hardware = measured_hardware(llm)
    if hardware is None:
        return
    from ..engine.speculative import BatchLimit
    from ..perf.bench import ModelWeightBits
    from ..perf.roofline import memory_bound_batch

    k, model = spec.num_speculative_tokens, llm.model
    sequences = memory_bound_batch(
        model.config, hardware, weights=ModelWeightBits(model), kv=llm.engine.runner.codec, decode_rows=1 + k
    )
    llm.engine.spec_batch_limit = BatchLimit.from_roofline(sequences, k)


def seed_tier_policy(llm, prompt_len: int = 512) -> None:
    """KV tiers: until the engine has timed a prefill, the tiers' load-or-recompute policy uses the roofline's
    prefill time per token on this machine (skipped when the machine has not been measured)."""
    tiers = llm.engine.tiers
    if tiers is None or tiers.seconds_per_token is not None:
        return
    hardware = measured_hardware(llm)
    if hardware is None:
        return
    from ..perf.bench import ModelWeightBits
    from ..perf.roofline import analyze

    model = llm.model
    pred = analyze(
        model.config,
        hardware,
        weights=ModelWeightBits(model),
        kv=llm.engine.runner.codec,
        prompt_len=prompt_len,
        context=prompt_len,
    )
    tiers.seconds_per_token = pred.prefill.time / prompt_len


def offload_kwargs(args: argparse.Namespace) -> dict:
    """The KV tiers' flags as LLM(...) keywords."""
    return {
        "kv_offload_dir": args.kv_offload_dir,
        "kv_offload_size": args.kv_offload_size,
        "kv_offload_disk_size": args.kv_offload_disk_size,
        "kv_offload_codec": args.kv_offload_codec,
    }


def save_run_config(llm, args: argparse.Namespace):
    """``--save-config FILE``: the engine's configuration as a run config (names and plain data only)."""
    import sys

    from ..kvcache.state import to_plain
    from ..optimize.run_config import RunConfig

    cache, sched = llm.config.cache, llm.config.scheduler
    path = RunConfig(
        model=args.model,
        dtype=args.dtype,
        weights=llm.config.weights,
        weight_overrides=llm.config.weight_overrides,
        kv_cache_dtype=cache.kv_cache_dtype,
        kv_calibration_state=to_plain(cache.kv_calibration_state),
        engine={
            "kv_cache_memory": cache.kv_cache_memory,
            "block_size": cache.block_size,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_num_seqs": sched.max_num_seqs,
            "long_prefill_token_threshold": sched.long_prefill_token_threshold,
            "scheduling_policy": sched.policy,
            "speculative_config": llm.config.speculative and llm.config.speculative.to_dict(),
            "enable_prefix_caching": cache.enable_prefix_caching,
        },
        notes={"source": "bytediet --save-config"},
    ).write(args.save_config)
    print(f"wrote {path}", file=sys.stderr)
    return path


def _needs_calibration(spec: str) -> bool:
    from ..calibrate.kv import needs_calibration
    from ..kvcache import get_kv_codec

    return needs_calibration(get_kv_codec(spec))


def plan_kv_budget_for(args: argparse.Namespace) -> dict:
    """A KV budget (``--kv-cache-dtype auto:<bits>``) or a codec that needs calibration (TurboQuant): load the model
    as it will run, choose the per-layer plan / calibrate on the calibration windows, say so (stderr) and hand over
    ``loaded``, the codec's name and its calibration state."""
    import sys

    from ..eval.harness import calibrated_kv_codec
    from ..models.loader import load_model

    model, tokenizer = load_model(
        args.model, dtype=args.dtype, weights=args.weights, keep_packed=args.keep_packed, activations=args.activations
    )
    calibration = dict(
        KV_CALIBRATION, corpus=args.kv_calib_corpus, windows=args.kv_calib_windows, window_len=args.kv_calib_len
    )
    codec = calibrated_kv_codec(args.kv_cache_dtype, model, tokenizer, calibration)
    if hasattr(codec, "plan_table"):
        print(codec.plan_table(model.config.num_kv_heads, model.config.head_dim), file=sys.stderr, flush=True)
    else:
        print(
            f"KV {codec.name} calibrated on {args.kv_calib_windows} × {args.kv_calib_len} tokens of "
            f"{args.kv_calib_corpus}'s calibration split (--kv-calib-windows 0 runs it uncalibrated)",
            file=sys.stderr,
            flush=True,
        )
    return {
        "kv_cache_dtype": codec.name,
        "kv_calibration_state": codec.calibration_state(),
        "loaded": (model, tokenizer),
    }
