"""Roofline what-if analysis of one transformer on one device: FLOPs, bytes, time and binding limit.

Per operator, attainable time = max(FLOPs / peak, bytes / bandwidth) (Williams, Waterman &
Patterson, "Roofline", CACM 2009); a phase's time is the sum over its operators (each kernel is
bound on its own; no overlap between kernels), plus tensor-parallel all-reduces.

Shapes (per layer): h = hidden, nh/nkv = query/KV heads, d = head_dim, I = intermediate, V = vocab.
A step processes T new tokens: prefill of L tokens at batch B has T = B·L, decode has T = B.

=========  ===========================  =======================================================
operator   FLOPs                        bytes moved
=========  ===========================  =======================================================
qkv        2·T·h·(nh+2nkv)·d            W·bpw/8 + T·h·a + T·(nh+2nkv)·d·a
attention  4·B·nh·d·P                   KV read + KV write at the codec's bytes/token + 2·T·nh·d·a
o_proj     2·T·nh·d·h                   W·bpw/8 + T·nh·d·a + T·h·a
mlp_gate   2·T·h·I (same for mlp_up)    W·bpw/8 + T·h·a + T·I·a
mlp_down   2·T·I·h                      W·bpw/8 + T·I·a + T·h·a
lm_head    2·B·h·V (last token only)    W·bpw/8 + B·h·a + B·V·a
embedding  0                            T·h·bpw/8 (rows gathered) + T·h·a
norms      4·T·h per norm               2·T·h·a per norm (+ its weight)
=========  ===========================  =======================================================

Mixture-of-experts layers (``num_experts`` E > 0, top-k, expert width I_e, shared width I_s) replace the
three mlp operators by:

=============  ====================  ==========================================================
router         2·T·h·E               E·h·a (kept in the compute dtype) + T·h·a + T·E·a
experts        2·T·k·3·h·I_e         U(T)·3·h·I_e·bpw/8 + T·k·(3h + 3I_e)·a
shared_expert  2·T·(3·h·I_s + h)     3·h·I_s·bpw/8 + h·a + T·(3h + 3I_s)·a
=============  ====================  ==========================================================

U(T) = E·(1 − (1 − k/E)^T) is the expected number of distinct experts that T tokens touch when each
picks k of E uniformly (balls into bins): k at a single-token decode step, all E for a long prefill.
The engine runs each touched expert once per step for all its tokens, so a decode step moves
attention + router + k experts + the shared expert, not all E experts (``active`` against ``total``
parameters: :attr:`~bytediet.config.ModelConfig.num_active_parameters`).

P is the number of (query, key) pairs per sequence: C at decode (the context, new token included),
L(L+1)/2 for a causal prefill, both clipped by a sliding window. Residual adds and the gated
activation are assumed fused into the neighbouring GEMMs. ``a`` = activation bytes (4 for fp32
compute, else 2). KV-cache size is the source document's formula
2 × layers × kv_heads × head_dim × seq_len × batch × bytes (``kv_cache_bytes``).

Tensor parallel over N chips (Megatron-LM, Shoeybi et al. 2019): GEMM weights, FLOPs and heads
split N ways, norms replicated; the collectives of one step are two all-reduces of T·h·a bytes per layer,
one more for the vocabulary-parallel embedding, and the all-gather of the B·V·a logits. A ring all-reduce
is 2(N−1) hops of bytes/N each, an all-gather N−1 (Patarasuk & Yuan 2009); each hop costs the link's
latency α (:attr:`~bytediet.perf.hardware.HardwareSpec.interconnect_latency`) plus its bytes over the
per-direction bandwidth: the α·hops term is what small decode messages pay (on a CPU's loopback gloo
it is most of the cost, ``bench/tp_step_time.py``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Protocol, Union

from ..config import ModelConfig
from ..errors import ConfigError
from .hardware import HardwareSpec


class HasBitsPerWeight(Protocol):
    def bits_per_weight(self, out_features: int, in_features: int) -> float: ...


class HasBytesPerToken(Protocol):
    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float: ...


WeightsLike = Union[float, int, HasBitsPerWeight]
KVLike = Union[float, int, HasBytesPerToken]


def weight_bits(weights: WeightsLike, out_features: int, in_features: int) -> float:
    """All-in bits per weight: a number, or a weight format's ``bits_per_weight(out, in)``."""
    if isinstance(weights, (int, float)):
        return float(weights)
    return float(weights.bits_per_weight(out_features, in_features))


def kv_bytes_per_token(kv: KVLike, num_kv_heads: int, head_dim: int) -> float:
    """Bytes of K and V for one token in one layer: a codec's ``bytes_per_token``, or bits per coordinate."""
    if isinstance(kv, (int, float)):
        return 2 * num_kv_heads * head_dim * float(kv) / 8
    return float(kv.bytes_per_token(num_kv_heads, head_dim))


def kv_cache_bytes(config: ModelConfig, seq_len: int, batch: int, bytes_per_element: float) -> float:
    """2 (K and V) × layers × kv_heads × head_dim × seq_len × batch × bytes (no sliding-window clipping)."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * seq_len * batch * bytes_per_element


def causal_pairs(length: int, window: Optional[int]) -> int:
    """(query, key) pairs of a causal prefill of ``length`` tokens: Σᵢ min(i, window) for i = 1..length."""
    w = length if window is None else min(window, length)
    return w * (w + 1) // 2 + (length - w) * w


def _mlp_shapes(hidden: int, inter: int) -> list[tuple[int, int]]:
    return [(inter, hidden), (inter, hidden), (hidden, inter)] if inter else []


def linear_shapes(config: ModelConfig, experts: Optional[int] = None) -> list[tuple[tuple[int, int], int]]:
    """``((out, in), count)`` of every quantizable linear weight of the layer stack (not the embeddings).

    ``experts``: how many experts of each MoE layer to count (all of them by default).
    """
    h, d = config.hidden_size, config.head_dim
    attn = [
        (config.num_heads * d, h),
        (config.num_kv_heads * d, h),
        (config.num_kv_heads * d, h),
        (h, config.num_heads * d),
    ]
    moe = config.num_moe_layers
    out = [(s, config.num_layers) for s in attn] + [
        (s, config.num_layers - moe) for s in _mlp_shapes(h, config.intermediate_size)
    ]
    if moe:
        e = config.num_experts if experts is None else experts
        out += [(s, moe * e) for s in _mlp_shapes(h, config.moe_intermediate_size)]
        out += [(s, moe) for s in _mlp_shapes(h, config.shared_expert_intermediate_size)]
    return out


def weights_bytes(config: ModelConfig, weights: WeightsLike, norm_bytes: float = 2.0) -> float:
    """Bytes of every stored weight: linear layers (every expert) and embeddings at the format's bits; norms,
    routers and shared-expert gates at ``norm_bytes``."""
    h, v = config.hidden_size, config.vocab_size
    shapes = linear_shapes(config)
    linear = sum(count * o * n * weight_bits(weights, o, n) / 8 for (o, n), count in shapes)
    emb = v * h * weight_bits(weights, v, h) / 8 * (1 if config.tie_word_embeddings else 2)
    norm_params = (
        config.num_parameters
        - sum(count * o * n for (o, n), count in shapes)
        - v * h * (1 if config.tie_word_embeddings else 2)
    )
    return linear + emb + norm_params * norm_bytes


def experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts that ``tokens`` tokens route to, each picking ``top_k`` of ``num_experts``
    uniformly: E·(1 − (1 − k/E)^T) (k for one token, → E as T grows)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class OpCost:
    """One operator summed over all layers of one step, on one chip."""

    name: str
    flops: float
    bytes: float
    t_compute: float
    t_memory: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else math.inf

    @property
    def time(self) -> float:
        return max(self.t_compute, self.t_memory)

    @property
    def bound(self) -> str:
        return "compute" if self.t_compute > self.t_memory else "memory"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "intensity": self.intensity, "time": self.time, "bound": self.bound}


@dataclass(frozen=True)
class PhaseCost:
    """One engine step: prefill of ``B×L`` tokens, or one decode step of ``B`` tokens."""

    phase: str
    tokens: int
    ops: tuple[OpCost, ...]
    allreduce_s: float = 0.0  # the step's collectives (tensor parallel), latency included
    allreduce_latency_s: float = 0.0  # of which the links' per-hop latency

    @property
    def flops(self) -> float:
        return sum(o.flops for o in self.ops)

    @property
    def bytes(self) -> float:
        return sum(o.bytes for o in self.ops)

    @property
    def time(self) -> float:
        return sum(o.time for o in self.ops) + self.allreduce_s

    @property
    def bound(self) -> str:
        """The limit that costs the most time in this phase: compute, memory or interconnect."""
        by = {"compute": 0.0, "memory": 0.0, "interconnect": self.allreduce_s}
        for o in self.ops:
            by[o.bound] += o.time
        return max(by, key=by.get)

    def op(self, name: str) -> OpCost:
        return next(o for o in self.ops if o.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "tokens": self.tokens,
            "flops": self.flops,
            "bytes": self.bytes,
            "intensity": self.flops / self.bytes,
            "allreduce_s": self.allreduce_s,
            "allreduce_latency_s": self.allreduce_latency_s,
            "time": self.time,
            "bound": self.bound,
            "ops": [o.to_dict() for o in self.ops],
        }


@dataclass(frozen=True)
class Prediction:
    """Everything the analyzer predicts for one (model, hardware, formats, batch, context, tp)."""

    model: str
    hardware: str
    compute_dtype: str
    batch: int
    context: int
    prompt_len: int
    tp: int
    weights_bytes: float
    kv_bytes_per_token: float  # all layers, one token, one sequence (before sliding-window clipping)
    kv_bytes: float  # B sequences of ``context`` tokens
    capacity_bytes: float
    max_batch: int
    chips_to_hold: int
    prefill: PhaseCost
    decode: PhaseCost
    extra: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.weights_bytes + self.kv_bytes <= self.capacity_bytes

    @property
    def ttft_s(self) -> float:
        return self.prefill.time

    @property
    def time_per_output_token_s(self) -> float:
        return self.decode.time

    @property
    def decode_tokens_per_s(self) -> float:
        """Aggregate decode throughput: B tokens per step."""
        return self.batch / self.decode.time

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "compute_dtype": self.compute_dtype,
            "batch": self.batch,
            "context": self.context,
            "prompt_len": self.prompt_len,
            "tp": self.tp,
            "weights_bytes": self.weights_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes": self.kv_bytes,
            "memory_needed_bytes": self.weights_bytes + self.kv_bytes,
            "capacity_bytes": self.capacity_bytes,
            "fits": self.fits,
            "max_batch": self.max_batch,
            "chips_to_hold": self.chips_to_hold,
            "ttft_s": self.ttft_s,
            "time_per_output_token_s": self.time_per_output_token_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "per_sequence_tokens_per_s": 1.0 / self.decode.time,
            "prefill": self.prefill.to_dict(),
            "decode": self.decode.to_dict(),
            **self.extra,
        }


@dataclass(frozen=True)
class _Ctx:
    cfg: ModelConfig
    hw: HardwareSpec
    weights: WeightsLike
    kv: KVLike
    peak: float
    act: float  # activation bytes per element
    tp: int

    def cost(self, name: str, flops: float, nbytes: float) -> OpCost:
        return OpCost(name, flops, nbytes, flops / self.peak, nbytes / self.hw.memory_bandwidth)

    def linear(self, name: str, t: int, n_in: int, n_out: int, count: int, column: bool) -> OpCost:
        """``count`` GEMMs (T×n_in)·(n_in×n_out); column-parallel splits n_out, row-parallel n_in."""
        n = self.tp
        w = n_in * n_out * weight_bits(self.weights, n_out, n_in) / 8 / n
        acts = t * n_in * self.act / (1 if column else n) + t * n_out * self.act / (n if column else 1)
        return self.cost(name, count * 2 * t * n_in * n_out / n, count * (w + acts))

    def attention(
        self, batch: int, q_per_seq: int, pairs_per_layer: list[int], kv_read_tokens: list[int], kv_written: int
    ) -> OpCost:
        c = self.cfg
        heads = math.ceil(c.num_heads / self.tp)
        kv_share = math.ceil(c.num_kv_heads / self.tp) / c.num_kv_heads  # KV heads replicate when tp > nkv
        bpt = kv_bytes_per_token(self.kv, c.num_kv_heads, c.head_dim) * kv_share
        flops = sum(4 * batch * heads * c.head_dim * p for p in pairs_per_layer)
        kv = sum(batch * (r + kv_written) * bpt for r in kv_read_tokens)
        qo = c.num_layers * 2 * batch * q_per_seq * heads * c.head_dim * self.act
        return self.cost("attention", flops, kv + qo)


def _phase(
    ctx: _Ctx, phase: str, batch: int, q_per_seq: int, pairs: list[int], kv_read: list[int], logit_rows: int = 0
) -> PhaseCost:
    """``logit_rows``: the rows the head scores (0: one per sequence)."""
    c, t, nl = ctx.cfg, batch * q_per_seq, ctx.cfg.num_layers
    h, d, v = c.hidden_size, c.head_dim, c.vocab_size
    norms_per_layer = 4 if c.sandwich_norm else 2
    norm_bytes = (nl * norms_per_layer + 1) * 2 * t * h * ctx.act
    if c.qk_norm:
        norm_bytes += nl * 2 * t * (c.num_heads + c.num_kv_heads) * d * ctx.act
    ops = (
        ctx.cost("embedding", 0.0, t * h * (weight_bits(ctx.weights, v, h) / 8 + ctx.act)),
        ctx.linear("qkv", t, h, (c.num_heads + 2 * c.num_kv_heads) * d, nl, column=True),
        ctx.attention(batch, q_per_seq, pairs, kv_read, kv_written=q_per_seq),
        ctx.linear("o_proj", t, c.num_heads * d, h, nl, column=False),
        *_mlp_ops(ctx, t, nl - c.num_moe_layers),
        *(_moe_ops(ctx, t) if c.num_moe_layers else ()),
        ctx.cost("norms", (nl * norms_per_layer + 1) * 4 * t * h, norm_bytes),
        ctx.linear("lm_head", logit_rows or batch, h, v, 1, column=True),
    )
    allreduce, latency = _collectives(ctx, t, logit_rows or batch) if ctx.tp > 1 else (0.0, 0.0)
    return PhaseCost(phase, t, ops, allreduce, latency)


def _collectives(ctx: _Ctx, t: int, logit_rows: int) -> tuple[float, float]:
    """(seconds, of which latency) of one step's collectives at tensor-parallel size N (module docstring)."""
    n, c = ctx.tp, ctx.cfg
    link = ctx.hw.link_bandwidth
    if not link:
        raise ConfigError(
            f"{ctx.hw.id} has no interconnect bandwidth in the catalogue; use --tp 1 "
            "(or give the link with bytediet roofline --link-bandwidth)"
        )
    reduces = 2 * c.num_layers + 1  # o_proj and down_proj per layer, and the embedding
    hops = reduces * 2 * (n - 1) + (n - 1)  # ... and the logits' all-gather
    data = reduces * 2 * (n - 1) / n * t * c.hidden_size * ctx.act + (n - 1) / n * logit_rows * c.vocab_size * ctx.act
    latency = hops * (ctx.hw.interconnect_latency or 0.0)
    return latency + data / link, latency


def ring_link(ranks: int, big_bytes: int, big_s: float, small_bytes: int, small_s: float) -> tuple[float, float]:
    """``(bus bandwidth B/s, per-hop latency s)`` of a link from two timed ring all-reduces over ``ranks``: the big
    message gives the bandwidth (each rank moves 2(N−1)/N of it), the small one, less its bytes over that
    bandwidth, the latency of its 2(N−1) hops (Patarasuk & Yuan 2009; what :func:`_collectives` charges)."""
    share = 2 * (ranks - 1) / ranks
    bus = share * big_bytes / big_s
    return bus, max(0.0, small_s - share * small_bytes / bus) / (2 * (ranks - 1))


def _mlp_ops(ctx: _Ctx, t: int, layers: int) -> tuple[OpCost, ...]:
    """The dense gated MLP of ``layers`` layers (none in an all-MoE model)."""
    h, i = ctx.cfg.hidden_size, ctx.cfg.intermediate_size
    if not layers:
        return ()
    return (
        ctx.linear("mlp_gate", t, h, i, layers, column=True),
        ctx.linear("mlp_up", t, h, i, layers, column=True),
        ctx.linear("mlp_down", t, i, h, layers, column=False),
    )


def _moe_ops(ctx: _Ctx, t: int) -> tuple[OpCost, ...]:
    """Router, routed experts and shared expert of every MoE layer for a step of ``t`` tokens (table above)."""
    c, n, a = ctx.cfg, ctx.tp, ctx.act
    h, e, k, ie, layers = c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.num_moe_layers
    router = ctx.cost("router", layers * 2 * t * h * e, layers * (e * h * a + t * h * a + t * e * a))
    expert_w = 3 * h * ie * weight_bits(ctx.weights, ie, h) / 8 / n
    ops = [
        router,
        ctx.cost(
            "experts",
            layers * 2 * t * k * 3 * h * ie / n,
            layers * (experts_touched(e, k, t) * expert_w + t * k * (3 * h + 3 * ie / n) * a),
        ),
    ]
    i_s = c.shared_expert_intermediate_size
    if i_s:
        w = 3 * h * i_s * weight_bits(ctx.weights, i_s, h) / 8 / n + h * a
        ops.append(
            ctx.cost(
                "shared_expert", layers * 2 * t * (3 * h * i_s / n + h), layers * (w + t * (3 * h + 3 * i_s / n) * a)
            )
        )
    return tuple(ops)


def analyze(
    config: ModelConfig,
    hardware: HardwareSpec,
    *,
    weights: WeightsLike = 16.0,
    kv: KVLike = 16.0,
    batch: int = 1,
    context: int = 4096,
    prompt_len: Optional[int] = None,
    tp: int = 1,
    compute_dtype: str = "auto",
    decode_rows: int = 1,
) -> Prediction:
    """Predict prefill and decode for ``batch`` sequences; decode attends to ``context`` tokens.

    ``decode_rows``: query rows per sequence in a decode step, each scored by the head (1 + k when it verifies k
    speculative drafts: the weights and the sequence's KV read once for all of them).

    ``weights``: bits per weight, or a weight format. ``kv``: bits per K/V coordinate, or a KV codec.
    ``prompt_len`` (default ``context``) is the prefill length L. ``compute_dtype`` "auto" is the hardware's
    ``compute_dtype_default``, else fp32 on a measured CPU (what the engine runs there) and bf16 elsewhere.
    """
    if batch < 1 or context < 1 or tp < 1 or decode_rows < 1:
        raise ConfigError("batch, context, tp and decode_rows must be at least 1")
    length = context if prompt_len is None else prompt_len
    if length < 1:
        raise ConfigError("prompt length must be at least 1")
    auto = hardware.compute_dtype_default or ("fp32" if hardware.measured else "bf16")
    dtype = auto if compute_dtype == "auto" else compute_dtype.lower()
    ctx = _Ctx(config, hardware, weights, kv, hardware.peak(dtype), 4.0 if dtype == "fp32" else 2.0, tp)
    windows = [config.window_for(layer) for layer in range(config.num_layers)]
    clip = lambda n, w: n if w is None else min(n, w)
    prefill = _phase(ctx, "prefill", batch, length, [causal_pairs(length, w) for w in windows], [0] * len(windows))
    decode = _phase(
        ctx,
        "decode",
        batch,
        decode_rows,
        [decode_rows * clip(context, w) for w in windows],
        [clip(context, w) - 1 for w in windows],
        logit_rows=batch * decode_rows,
    )
    kv_token_layer = kv_bytes_per_token(kv, config.num_kv_heads, config.head_dim)
    kv_per_seq = sum(clip(context, w) for w in windows) * kv_token_layer
    w_bytes = weights_bytes(config, weights)
    capacity = hardware.memory_bytes * tp
    return Prediction(
        model=config.name or config.architecture,
        hardware=hardware.id,
        compute_dtype=hardware.compute_dtype(dtype),
        batch=batch,
        context=context,
        prompt_len=length,
        tp=tp,
        weights_bytes=w_bytes,
        kv_bytes_per_token=kv_token_layer * config.num_layers,
        kv_bytes=batch * kv_per_seq,
        capacity_bytes=capacity,
        max_batch=max(0, int((capacity - w_bytes) // kv_per_seq)),
        chips_to_hold=hardware.chips_to_hold(w_bytes + batch * kv_per_seq),
        prefill=prefill,
        decode=decode,
        extra={"num_parameters": config.num_parameters, "num_active_parameters": config.num_active_parameters},
    )


WEIGHTLESS_OPS = ("embedding", "attention", "norms")  # a step's operators that multiply no weight matrix


def memory_bound_batch(
    config: ModelConfig,
    hardware: HardwareSpec,
    *,
    weights: WeightsLike = 16.0,
    kv: KVLike = 16.0,
    context: int = 512,
    decode_rows: int = 1,
    most: int = 4096,
) -> int:
    """The most sequences a decode step of ``decode_rows`` query rows each (1 + k verifying k drafts) holds while its
    weight products stay memory-bound on the roofline (capped at ``most``); 0 when one sequence's already are
    compute-bound. Up to there a weight read serves more rows for free; beyond, each row costs its arithmetic, so
    speculation no longer pays for itself (engine/speculative.py). Attention is left out: each sequence reads its own
    KV, whatever the batch."""

    def memory_bound(batch: int) -> bool:
        pred = analyze(config, hardware, weights=weights, kv=kv, batch=batch, context=context, decode_rows=decode_rows)
        products = [o for o in pred.decode.ops if o.name not in WEIGHTLESS_OPS]
        return sum(o.t_compute for o in products) <= sum(o.t_memory for o in products)

    if not memory_bound(1):
        return 0
    lo, hi = 1, 2
    while hi <= most and memory_bound(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, most + 1)  # past the cap counts as compute-bound
    while hi - lo > 1:  # memory_bound(lo) and not memory_bound(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if memory_bound(mid) else (lo, mid)
    return lo


def compare_with_measurement(
    prediction: Prediction, measured_tokens_per_s: float, measured_ttft_s: Optional[float] = None
) -> dict[str, Any]:
    """Put a measured decode throughput (aggregate tokens/s at ``prediction.batch``) beside the prediction.

    Returns predicted and measured tokens/s, their ratio, whether they agree within 20%, and the
    achieved bandwidth (bytes per decode step × steps/s) against the device's ceiling — the gpt-fast
    style check that says *why* a run is slower than predicted (overhead vs. bandwidth).
    """
    if measured_tokens_per_s <= 0:
        raise ConfigError("measured tokens/s must be positive")
    predicted = prediction.decode_tokens_per_s
    steps_per_s = measured_tokens_per_s / prediction.batch
    achieved_bw = prediction.decode.bytes * steps_per_s
    ceiling = prediction.decode.bytes / prediction.decode.time  # the predicted run's effective B/s
    out = {
        "model": prediction.model,
        "hardware": prediction.hardware,
        "batch": prediction.batch,
        "context": prediction.context,
        "predicted_tokens_per_s": predicted,
        "measured_tokens_per_s": measured_tokens_per_s,
        "measured_over_predicted": measured_tokens_per_s / predicted,
        "error_pct": 100.0 * (measured_tokens_per_s - predicted) / predicted,
        "within_20pct": abs(measured_tokens_per_s - predicted) <= 0.2 * predicted,
        "decode_bytes_per_step": prediction.decode.bytes,
        "achieved_bandwidth": achieved_bw,
        "predicted_bandwidth": ceiling,
        "unexplained_s_per_step": 1.0 / steps_per_s - prediction.decode.time,
    }
    if measured_ttft_s is not None:
        out.update(
            predicted_ttft_s=prediction.ttft_s,
            measured_ttft_s=measured_ttft_s,
            ttft_measured_over_predicted=measured_ttft_s / prediction.ttft_s,
        )
    return out


def rank_hardware(
    config: ModelConfig,
    hardware: list[HardwareSpec],
    *,
    weights: WeightsLike,
    kv: KVLike,
    batches: list[int],
    context: int,
    prompt_len: Optional[int] = None,
    tp: int = 1,
    compute_dtype: str = "auto",
    max_batch_cap: int = 1024,
) -> dict[str, Any]:
    """The source documents' "hardware portfolio": which device for latency, which for throughput.

    Each device gets the fewest chips that hold weights + one sequence's KV (at least ``tp``; a Groq
    LPU needs hundreds). Latency = time per output token at batch 1. Throughput = the best aggregate
    decode tokens/s over ``batches`` and the largest batch that fits (capped at ``max_batch_cap``),
    also per chip, since a device that needs 8× the chips is not 8× the value.
    """
    rows = []
    for hw in hardware:
        run = functools.partial(  # this device's analysis, at a batch and chip count
            analyze,
            config,
            hw,
            weights=weights,
            kv=kv,
            context=context,
            prompt_len=prompt_len,
            compute_dtype=compute_dtype,
        )
        one = run(batch=1, tp=tp)
        chips = max(tp, one.chips_to_hold)
        if chips > 1 and not hw.link_bandwidth:
            rows.append(
                {
                    "hardware": hw.id,
                    "chips": chips,
                    "fits": False,
                    "reason": "needs more than one chip and has no interconnect",
                }
            )
            continue
        if chips != tp:
            one = run(batch=1, tp=chips)
        candidates = sorted({b for b in batches if b <= one.max_batch} | {min(one.max_batch, max_batch_cap)} - {0})
        best = max((run(batch=b, tp=chips) for b in candidates or [1]), key=lambda p: p.decode_tokens_per_s)
        rows.append(
            {
                "hardware": hw.id,
                "chips": chips,
                "fits": True,
                "time_per_output_token_s": one.time_per_output_token_s,
                "ttft_s": one.ttft_s,
                "decode_bound": one.decode.bound,
                "max_batch": one.max_batch,
                "best_batch": best.batch,
                "throughput_tokens_per_s": best.decode_tokens_per_s,
                "throughput_per_chip": best.decode_tokens_per_s / chips,
                "throughput_bound": best.decode.bound,
            }
        )
    ok = [r for r in rows if r["fits"]]
    return {
        "rows": rows,
        "latency_ranking": [r["hardware"] for r in sorted(ok, key=lambda r: r["time_per_output_token_s"])],
        "throughput_ranking": [r["hardware"] for r in sorted(ok, key=lambda r: -r["throughput_per_chip"])],
    }
