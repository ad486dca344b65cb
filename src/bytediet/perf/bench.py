"""Side-by-side serving benchmark: bytediet against peers (llama.cpp, transformers) on the same weights.

Every system answers one call, ``serve(prompts, max_tokens, concurrency) → [RequestTiming]``: all
requests arrive at t = 0 and at most ``concurrency`` are in flight. Per request (the definitions of
vLLM's ``benchmark_serving``):

    TTFT = first token − arrival        TPOT = (finish − first token) / (output tokens − 1)
    aggregate throughput = Σ output tokens / (last finish − first arrival)

The run has four parts: a single stream (prefill of a 512-token prompt; 128 decode tokens after
it), a concurrency sweep on a seeded mix of Austen prompts and output lengths, — for bytediet
only — the roofline check: clean decode steps at batch B measured against
:func:`bytediet.perf.roofline.analyze` for the same model, weight format, KV codec, batch and context,
and context scaling: batch-1 decode of ``context_new_tokens`` tokens whose context ends at each of
``contexts`` (512, 2048, 8192 tokens of Austen), with the roofline's predicted step time beside bytediet's.
Extra bytediet systems (``variants``: other weight formats of the same model) run the single-stream and
context parts in the same run, so every format is compared with the same peer measurement.
At tensor-parallel size N (``ours`` split across N processes) every part runs as it does at size 1, and the
roofline predicts for N chips whose link is the ranks' own all-reduce, measured (:func:`with_measured_link`).
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Protocol, Sequence

from ..errors import ConfigError

Progress = Callable[[str], None]
PARTS = ("single", "concurrency", "roofline", "context", "prefix-cache")
VARIANT_PARTS = ("single", "context")  # the parts extra bytediet systems (other weight formats) run
CONCURRENCY_INFO = ("system", "package", "version", "concurrency_mode", "last_server_command")  # what ran the sweep


@dataclass(frozen=True)
class RequestTiming:
    """One request's timeline, seconds since its arrival (every request arrives at t = 0)."""

    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    finish_s: float

    @property
    def tpot_s(self) -> Optional[float]:
        """Time per output token after the first; None for a one-token request."""
        return (self.finish_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0–100) by linear interpolation between order statistics.

    Hyndman & Fan (1996) definition 7, the default of numpy and R: rank h = (n − 1)·q/100,
    value = x[⌊h⌋] + (h − ⌊h⌋)·(x[⌊h⌋+1] − x[⌊h⌋]).
    """
    if not values:
        raise ConfigError("percentile of an empty list")
    if not 0 <= q <= 100:
        raise ConfigError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    h = (len(xs) - 1) * q / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def summarize(timings: Sequence[RequestTiming]) -> dict:
    """Aggregate throughput and TTFT / TPOT p50, p99 and mean of one workload run."""
    if not timings:
        raise ConfigError("no requests to summarize")
    duration = max(t.finish_s for t in timings)
    out_tokens = sum(t.output_tokens for t in timings)
    ttft = [t.ttft_s for t in timings]
    tpot = [t.tpot_s for t in timings if t.tpot_s is not None]
    stats = {
        "requests": len(timings),
        "prompt_tokens": sum(t.prompt_tokens for t in timings),
        "output_tokens": out_tokens,
        "duration_s": duration,
        "output_tokens_per_s": out_tokens / duration,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": statistics.fmean(ttft),
    }
    for name, q in (("p50", 50), ("p99", 99)):
        stats[f"tpot_{name}_s"] = percentile(tpot, q) if tpot else None
    stats["tpot_mean_s"] = statistics.fmean(tpot) if tpot else None
    return stats


@dataclass(frozen=True)
class BenchConfig:
    """Sizes of every workload. ``quick()`` shrinks them to seconds (tests, CI)."""

    threads: int = 2
    prefill_len: int = 512  # single stream: prefill tok/s of this prompt (median of ``prefill_repeats``)
    prefill_repeats: int = 3
    decode_prompt_len: int = 512  # single stream: decode tok/s of ``decode_new_tokens`` after this prompt
    decode_new_tokens: int = 128
    concurrency: tuple[int, ...] = (1, 4, 16, 32, 64)
    min_requests: int = 4  # requests per concurrency level: max(level, min_requests)
    prompt_len_range: tuple[int, int] = (64, 512)
    output_len_range: tuple[int, int] = (32, 128)
    roofline_batches: tuple[int, ...] = (1, 16)
    roofline_prompt_len: int = 64
    roofline_steps: int = 16
    contexts: tuple[int, ...] = (512, 2048, 8192)  # context part: the context each decode run ends at
    context_new_tokens: int = 48
    # prefix-cache part (bytediet.perf.prefix_cache): a repeated long prompt, and a multi-turn chat
    prefix_prompt_len: int = 8192
    prefix_new_tokens: int = 16
    prefix_offload_size: str = "4GiB"
    chat_system_prompts: int = 8
    chat_system_len: int = 2048
    chat_conversations: int = 32
    chat_turns: int = 2
    chat_turn_len: int = 64
    chat_new_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        positive = (
            "threads",
            "prefill_len",
            "prefill_repeats",
            "decode_prompt_len",
            "decode_new_tokens",
            "min_requests",
            "roofline_prompt_len",
            "roofline_steps",
            "prefix_prompt_len",
        )
        if self.context_new_tokens < 2:
            raise ConfigError("bench: context_new_tokens must be at least 2 (decode speed needs two tokens)")
        if any(n <= self.context_new_tokens for n in self.contexts):
            raise ConfigError(
                f"bench: every context must exceed context_new_tokens ({self.context_new_tokens}), got {self.contexts}"
            )
        for key in positive:
            if getattr(self, key) < 1:
                raise ConfigError(f"bench: {key} must be at least 1, got {getattr(self, key)}")
        if self.decode_new_tokens < 2:
            raise ConfigError("bench: decode_new_tokens must be at least 2 (decode speed needs two tokens)")
        for key in ("concurrency", "roofline_batches"):
            if any(c < 1 for c in getattr(self, key)):
                raise ConfigError(f"bench: every {key} level must be at least 1")
        for key in ("prompt_len_range", "output_len_range"):
            lo, hi = getattr(self, key)
            if not 1 <= lo <= hi:
                raise ConfigError(f"bench: {key} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")

    @classmethod
    def quick(cls, **overrides) -> "BenchConfig":
        small = dict(
            prefill_len=24,
            prefill_repeats=1,
            decode_prompt_len=24,
            decode_new_tokens=6,
            concurrency=(1, 4),
            min_requests=2,
            prompt_len_range=(8, 32),
            output_len_range=(2, 6),
            roofline_batches=(1, 4),
            roofline_prompt_len=8,
            roofline_steps=3,
            contexts=(24, 48),
            context_new_tokens=4,
            prefix_prompt_len=64,
            prefix_new_tokens=4,
            prefix_offload_size="64MiB",
            chat_system_prompts=2,
            chat_system_len=64,
            chat_conversations=4,
            chat_turns=2,
            chat_turn_len=8,
            chat_new_tokens=3,
        )
        return cls(**{**small, **overrides})

    @property
    def max_sequence_len(self) -> int:
        return max(
            self.prefill_len + 1,
            self.decode_prompt_len + self.decode_new_tokens,
            self.prompt_len_range[1] + self.output_len_range[1],
            self.roofline_prompt_len + self.roofline_steps + 2,
        )

    def longest_sequence(self, parts: Sequence[str]) -> int:
        """Tokens the longest request of these parts holds (corpus length, the peers' context size)."""
        return max([self.max_sequence_len, *(self.contexts if "context" in parts else ())])

    def corpus_tokens(self, parts: Sequence[str]) -> int:
        """Distinct corpus tokens the parts' prompts are cut from (the prefix-cache part's prompts never repeat)."""
        if "prefix-cache" not in parts:
            return self.longest_sequence(parts)
        chat = (
            self.chat_system_prompts * self.chat_system_len
            + self.chat_conversations * self.chat_turns * self.chat_turn_len
        )
        return max(self.longest_sequence(parts), 2 * self.prefix_prompt_len, chat)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Workload:
    """Prompts (token ids) and output lengths, identical for every system."""

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]

    def describe(self) -> dict:
        lens = [len(p) for p in self.prompts]
        return {
            "requests": len(lens),
            "prompt_tokens": sum(lens),
            "prompt_len_min": min(lens),
            "prompt_len_max": max(lens),
            "output_tokens": sum(self.max_tokens),
            "output_len_min": min(self.max_tokens),
            "output_len_max": max(self.max_tokens),
        }


def make_workload(
    corpus_ids: Sequence[int], n_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int
) -> Workload:
    """``n_requests`` prompts cut from ``corpus_ids`` at seeded offsets, with seeded uniform lengths."""
    if len(corpus_ids) <= prompt_range[1]:
        raise ConfigError(f"the corpus has {len(corpus_ids)} tokens; prompts of up to {prompt_range[1]} need more")
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n_requests):
        n = rng.randint(*prompt_range)
        start = rng.randrange(0, len(corpus_ids) - n)
        prompts.append(tuple(int(t) for t in corpus_ids[start : start + n]))
        outs.append(rng.randint(*output_range))
    return Workload(tuple(prompts), tuple(outs))


def random_token_ids(vocab_size: int, min_tokens: int, seed: int = 0) -> tuple[list[int], str]:
    """Seeded random token ids: the workload text of a model without a tokenizer (a corpus needs one:
    :func:`bytediet.eval.corpus.corpus_token_ids`)."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(max(4 * min_tokens, 1024))], "random token ids"


class System(Protocol):
    """A serving system under test (bytediet or a peer)."""

    name: str

    def info(self) -> dict: ...

    def serve(
        self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], concurrency: int
    ) -> list[RequestTiming]: ...

    def close(self) -> None: ...


@dataclass
class Unavailable:
    """A peer that could not be set up; reported in the results instead of failing the run."""

    name: str
    reason: str


@dataclass
class BenchContext:
    config: BenchConfig
    corpus_ids: list[int]
    corpus_label: str
    read_bandwidth: Optional[float] = None  # B/s, this machine's measured read bandwidth
    progress: Progress = field(default=lambda msg: None)


def measure_single(system: System, ctx: BenchContext) -> dict:
    """Prefill tok/s of ``prefill_len`` tokens (median TTFT) and decode tok/s after ``decode_prompt_len``."""
    c, ids = ctx.config, ctx.corpus_ids
    if len(ids) < max(c.prefill_len, c.decode_prompt_len) + 1:
        raise ConfigError("the corpus is shorter than the single-stream prompts")
    prefill_prompt = ids[: c.prefill_len]
    ttfts = []
    for _ in range(c.prefill_repeats):
        ttfts.append(system.serve([prefill_prompt], [1], 1)[0].ttft_s)
    decode_prompt = ids[len(ids) // 2 : len(ids) // 2 + c.decode_prompt_len]  # not the prefill prompt
    run = system.serve([decode_prompt], [c.decode_new_tokens], 1)[0]
    ttft = statistics.median(ttfts)
    decode_tps = 1.0 / run.tpot_s
    out = {
        "prefill_tokens": c.prefill_len,
        "prefill_ttft_s": ttft,
        "prefill_tokens_per_s": c.prefill_len / ttft,
        "decode_prompt_tokens": c.decode_prompt_len,
        "decode_tokens": run.output_tokens,
        "decode_ttft_s": run.ttft_s,
        "decode_tokens_per_s": decode_tps,
    }
    info = system.info()
    weight_bytes = info.get("decode_weight_bytes") or info.get("weight_bytes")
    if weight_bytes:
        achieved = weight_bytes * decode_tps  # batch 1: each decode step reads every weight once (MoE: top-k experts)
        out["achieved_weight_gb_per_s"] = achieved / 1e9
        if ctx.read_bandwidth:
            out["fraction_of_read_bandwidth"] = achieved / ctx.read_bandwidth
    return out


def measure_concurrency(system: System, ctx: BenchContext) -> dict[str, dict]:
    """One seeded workload per level (the same for every system); level → summary."""
    c, results = ctx.config, {}
    for level in c.concurrency:
        work = make_workload(
            ctx.corpus_ids, max(level, c.min_requests), c.prompt_len_range, c.output_len_range, seed=c.seed + level
        )
        ctx.progress(f"{system.name}: {len(work.prompts)} requests at concurrency {level}")
        results[str(level)] = summarize(system.serve(work.prompts, work.max_tokens, level))
    return results


def measure_context(system: System, ctx: BenchContext) -> dict[str, dict]:
    """Batch-1 greedy decode whose context ends at each of ``contexts``: prompt of N − new tokens, then
    ``context_new_tokens`` decoded (decode tok/s from the first-token and finish times). context → result."""
    c, ids, out = ctx.config, ctx.corpus_ids, {}
    for n in c.contexts:
        prompt_len = n - c.context_new_tokens
        if len(ids) < prompt_len:
            raise ConfigError(f"the corpus ({len(ids)} tokens) is shorter than the {prompt_len}-token context prompt")
        ctx.progress(f"{system.name}: decode at context {n}")
        run = system.serve([ids[:prompt_len]], [c.context_new_tokens], 1)[0]
        out[str(n)] = {
            "prompt_tokens": prompt_len,
            "decode_tokens": run.output_tokens,
            "ttft_s": run.ttft_s,
            "decode_tokens_per_s": 1.0 / run.tpot_s,
            "decode_step_s": run.tpot_s,
        }
    return out


def run_system(system: System, ctx: BenchContext, parts: Sequence[str]) -> dict:
    """Warm up, then the single stream, the concurrency sweep and the context part for one system.

    A system with ``part_system(part)`` may hand a part to another system (llama.cpp's concurrency sweep
    runs on llama-server); ``out["concurrency_system"]`` records which one ran the sweep."""
    ctx.progress(f"{system.name}: warm-up")
    system.serve([ctx.corpus_ids[:8]], [2], 1)
    out: dict = {"available": True, "info": system.info()}
    if "single" in parts:
        ctx.progress(f"{system.name}: single stream")
        out["single"] = measure_single(system, ctx)
    if "concurrency" in parts:
        sweep = system.part_system("concurrency") if hasattr(system, "part_system") else system
        if sweep is not system:  # e.g. llama.cpp's sweep on llama-server
            ctx.progress(f"{system.name}: concurrency sweep on {sweep.name}, warm-up")
            sweep.serve([ctx.corpus_ids[:8]], [2], 1)
        out["concurrency"] = measure_concurrency(sweep, ctx)
        out["concurrency_system"] = {k: v for k, v in sweep.info().items() if k in CONCURRENCY_INFO}
    if "context" in parts:
        out["context"] = measure_context(system, ctx)
    return out


def ratios(ours: dict, peer: dict) -> dict:
    """bytediet / peer for every shared metric (> 1 = bytediet faster for tok/s, slower for times)."""

    def div(a, b):
        return a / b if a is not None and b else None

    out: dict = {}
    if "single" in ours and "single" in peer:
        for key in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            out[key] = div(ours["single"][key], peer["single"][key])
    for n, mine in ours.get("context", {}).items():
        theirs = peer.get("context", {}).get(n)
        if theirs:
            out[f"context_{n}"] = div(mine["decode_tokens_per_s"], theirs["decode_tokens_per_s"])
    for level, mine in ours.get("concurrency", {}).items():
        theirs = peer.get("concurrency", {}).get(level)
        if theirs:
            out[f"concurrency_{level}"] = {
                k: div(mine[k], theirs[k]) for k in ("output_tokens_per_s", "ttft_p50_s", "tpot_p50_s")
            }
    return out


def crippled_peer(measured: dict) -> str:
    """Why no ratio may be reported against this peer's measurement ('' when it ran at its best): llama.cpp with its
    repacked kernels (extra buffer types) off runs several times slower than a user's build on the same CPU."""
    info = measured.get("info") or {}
    if info.get("extra_buffer_types") is False:
        from .llama_build import REBUILD_HINT

        return (
            f"{info.get('system', 'the peer')} ran with its repacked kernels off "
            f"({info.get('extra_buffer_types_note')}); {REBUILD_HINT}"
        )
    return ""


def machine_info() -> dict:
    from .measure import cpu_model

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def run_bench(
    ours,
    peers: Sequence,
    config: BenchConfig,
    *,
    parts: Sequence[str] = PARTS,
    read_bandwidth: Optional[float] = None,
    hardware=None,
    corpus: Optional[tuple[list[int], str]] = None,
    progress: Progress = lambda msg: None,
    checkpoint: Callable[[dict], None] = lambda partial: None,
    variants: Sequence = (),
) -> dict:
    """Run every part for ``ours`` (a :class:`bytediet.perf.peers.BytedietSystem`) and each peer (a
    :class:`System` or :class:`Unavailable`); returns one JSON-able dict.

    ``variants``: more bytediet systems (the same model in other weight formats, each with its own
    ``name``) that run the :data:`VARIANT_PARTS` of ``parts`` right after ``ours``; their ratios to
    each peer are in ``result["ratios"][peer][variant name]``.
    ``hardware``: the :class:`HardwareSpec` the roofline predicts for (default: this machine, measured).
    ``checkpoint`` receives the partial result after each system (a long run keeps what it measured).
    """
    bad = set(parts) - set(PARTS)
    if bad:
        raise ConfigError(f"unknown bench part(s) {sorted(bad)}; choose from {', '.join(PARTS)}")
    if corpus is None and ours.tokenizer is not None:
        raise ConfigError(
            "run_bench: pass corpus=bytediet.eval.corpus.corpus_token_ids(...) for a model with a tokenizer"
        )
    ids, label = corpus or random_token_ids(ours.model.config.vocab_size, config.corpus_tokens(parts), config.seed)
    if hardware is None and ("roofline" in parts or "context" in parts):
        from .measure import this_machine

        hardware = this_machine(measure_if_missing=True, threads=config.threads)
    bw = read_bandwidth or (hardware.memory_bandwidth if hardware is not None else None)
    ctx = BenchContext(config, list(ids), label, bw, progress)
    tp = getattr(ours, "tensor_parallel_size", 1)
    result = {
        "machine": machine_info(),
        "config": config.to_dict(),
        "parts": list(parts),
        "corpus": label,
        "tensor_parallel_size": tp,
        "read_bandwidth_gb_per_s": bw / 1e9 if bw else None,
        "systems": {},
        "ratios": {},
    }
    if tp > 1 and ("roofline" in parts or "context" in parts) and not hardware.link_bandwidth:
        hardware, result["link"] = with_measured_link(ours, hardware, progress)
    result["systems"][ours.name] = run_system(ours, ctx, parts)
    if "roofline" in parts:
        result["roofline"] = roofline_section(ours, hardware, ctx, result["systems"][ours.name].get("single"))
    if "context" in parts:
        result["context_roofline"] = context_roofline(ours, hardware, config, result["systems"][ours.name]["context"])
    if "prefix-cache" in parts:
        from .prefix_cache import measure_prefix_cache

        result["prefix_cache"] = measure_prefix_cache(ours, config, ids, progress)
    checkpoint(result)
    variant_parts = [p for p in parts if p in VARIANT_PARTS]
    for variant in variants:
        if variant_parts:
            result["systems"][variant.name] = run_system(variant, ctx, variant_parts)
        variant.close()
        checkpoint(result)
    mine = [ours.name] + [v.name for v in variants if v.name in result["systems"]]
    for peer in peers:
        result["systems"][peer.name] = _run_peer(peer, ctx, parts)
        refused = crippled_peer(result["systems"][peer.name])
        if refused:
            result["ratios"][peer.name] = {"refused": refused}
        elif result["systems"][peer.name]["available"]:
            result["ratios"][peer.name] = ratios(result["systems"][ours.name], result["systems"][peer.name])
            for name in mine[1:]:
                result["ratios"][peer.name][name] = ratios(result["systems"][name], result["systems"][peer.name])
        checkpoint(result)
    result["machine"]["load_average_end"] = list(os.getloadavg())
    return result


def with_measured_link(ours, hardware, progress: Progress = lambda msg: None):
    """``(hardware with the link measured between ours's ranks, what was measured)``: a host's processes share
    no catalogued interconnect, and the roofline at tensor-parallel size N > 1 needs one (its all-reduce term)."""
    from dataclasses import replace

    progress(f"{ours.name}: all-reduce between its {ours.tensor_parallel_size} ranks (the roofline's link)")
    link = ours.measure_link()
    # interconnect_bandwidth counts both directions; the analyzer's link_bandwidth (the bus) is half of it
    spec = replace(
        hardware, interconnect_bandwidth=2 * link["bus_bandwidth"], interconnect_latency=link["hop_latency_s"]
    )
    return spec, {
        "how": link["how"],
        "allreduce_s": link["allreduce_s"],
        "small_allreduce_s": link["small_allreduce_s"],
        "hop_latency_us": link["hop_latency_s"] * 1e6,
        "bus_bandwidth_gb_per_s": link["bus_bandwidth"] / 1e9,
    }


def _run_peer(peer, ctx: BenchContext, parts: Sequence[str]) -> dict:
    if isinstance(peer, Unavailable):
        return {"available": False, "reason": f"unavailable: {peer.reason}"}
    try:
        return run_system(peer, ctx, [p for p in parts if p != "roofline"])
    except Exception as exc:  # a peer's failure is a result, not a crash of the whole benchmark
        return {"available": False, "reason": f"failed: {type(exc).__name__}: {exc}"}
    finally:
        peer.close()


def context_roofline(ours, hardware, config: BenchConfig, measured: dict) -> list[dict]:
    """The roofline's batch-1 decode step at each context of the context part (mean context of the decode
    run: N − new/2), beside bytediet's measured step and its KV bytes read per step."""
    from .roofline import analyze

    weights, kv, rows = ModelWeightBits(ours.model), ours.kv_codec(), []
    cfg, tp = _full_config(ours), getattr(ours, "tensor_parallel_size", 1)
    for n, m in measured.items():
        mean_ctx = int(n) - config.context_new_tokens // 2
        pred = analyze(cfg, hardware, weights=weights, kv=kv, batch=1, prompt_len=int(n), context=mean_ctx, tp=tp)
        rows.append(
            {
                "context": int(n),
                "predicted_step_s": pred.decode.time,
                "predicted_bound": pred.decode.bound,
                "measured_step_s": m["decode_step_s"],
                "measured_over_predicted": m["decode_step_s"] / pred.decode.time,
                "kv_bytes_per_step": pred.kv_bytes,
                "weight_bytes": pred.weights_bytes,
            }
        )
    return rows


# ----------------------------------------------------------------------------------- roofline check
class ModelWeightBits:
    """``bits_per_weight(out, in)`` of a loaded model's own linear layers, for the roofline analyzer.

    Asked for a shape the model has, it answers with that layer's format; for a fused shape it does
    not have (the analyzer's fused QKV), with the format of a layer with the same ``in_features``.
    """

    def __init__(self, model) -> None:
        from ..distributed.shard import full_shape

        full = getattr(model, "full_config", None)  # a tensor-parallel shard: its layers' shapes in the whole model
        self.by_shape, self.by_in = {}, {}
        for name, lin in model.linear_layers():
            shape = (lin.out_features, lin.in_features)
            out_features, in_features = shape if full is None else full_shape(name, shape, full)
            self.by_shape.setdefault((out_features, in_features), lin.format)
            if name != "lm_head":
                self.by_in.setdefault(in_features, lin.format)
        if not self.by_shape:
            raise ConfigError("the model has no linear layers")

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        fmt = (
            self.by_shape.get((out_features, in_features))
            or self.by_in.get(in_features)
            or next(iter(self.by_shape.values()))
        )
        return float(fmt.bits_per_weight(out_features, in_features))


def roofline_row(kind: str, prediction, measured_tps: float, measured_ttft: Optional[float] = None) -> dict:
    from .roofline import compare_with_measurement

    row = {"measurement": kind, **compare_with_measurement(prediction, measured_tps, measured_ttft)}
    row.update(
        predicted_step_s=prediction.decode.time,
        predicted_bound=prediction.decode.bound,
        measured_step_s=prediction.batch / measured_tps,
    )
    return row


def roofline_section(ours, hardware, ctx: BenchContext, single: Optional[dict]) -> dict:
    """Predicted (roofline analyzer) vs measured decode tok/s for bytediet at each batch size.

    The single-stream run is compared at batch 1 (context = prompt + half the output); each batch in
    ``roofline_batches`` is measured as ``roofline_steps`` clean decode steps with the whole batch
    running, at context = prompt + 1 + half the steps. Each such row splits the measured step: the
    linear layers alone (``linear_pass_s``), the rest of the forward pass, and the engine's Python
    around it (``overhead_s_per_step``: scheduling, sampling, detokenization).
    """
    from .roofline import analyze

    c, cfg, tp = ctx.config, _full_config(ours), getattr(ours, "tensor_parallel_size", 1)
    weights, kv = ModelWeightBits(ours.model), ours.kv_codec()
    rows = []
    if single:
        pred = analyze(
            cfg,
            hardware,
            weights=weights,
            kv=kv,
            batch=1,
            prompt_len=c.decode_prompt_len,
            context=c.decode_prompt_len + c.decode_new_tokens // 2,
            tp=tp,
        )
        rows.append(roofline_row("single stream", pred, single["decode_tokens_per_s"], single["decode_ttft_s"]))
    for batch in c.roofline_batches:
        ctx.progress(f"{ours.name}: {c.roofline_steps} decode steps at batch {batch}")
        work = make_workload(ctx.corpus_ids, batch, (c.roofline_prompt_len,) * 2, (1, 1), seed=c.seed + 1000 + batch)
        measured = ours.decode_steps(work.prompts, c.roofline_steps)
        pred = analyze(
            cfg,
            hardware,
            weights=weights,
            kv=kv,
            batch=batch,
            prompt_len=c.roofline_prompt_len,
            context=c.roofline_prompt_len + 1 + c.roofline_steps // 2,
            tp=tp,
        )
        row = roofline_row("decode steps", pred, measured["tokens_per_s"])
        row.update(
            forward_s_per_step=measured["forward_s_per_step"],
            overhead_s_per_step=measured["overhead_s_per_step"],
            linear_pass_s=ours.linear_pass_s(batch),
        )
        rows.append(row)
    return {
        "hardware": hardware.id,
        "hardware_name": hardware.name,
        "weights": ours.info()["weights"],
        "kv": kv.describe(),
        "tp": tp,
        "rows": rows,
    }


def _full_config(ours):
    """The whole model's configuration (a tensor-parallel system's rank-0 shard has its own heads only)."""
    return getattr(ours.model, "full_config", ours.model.config)
