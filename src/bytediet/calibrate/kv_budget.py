"""``auto:<bits>``: choose, per layer and separately for K and V, the KV codec that minimises attention error
under a byte budget (the plan of :class:`bytediet.kvcache.auto.BudgetCodec`).

The machinery of weight mixed precision (:mod:`bytediet.calibrate.mixed`), applied to the KV cache:

1. **Sensitivity by measurement.** Capture every layer's post-RoPE K, V and Q on calibration windows
   (:func:`~bytediet.calibrate.kv.capture_kv`). For each layer, side (K or V) and candidate, store that side
   alone with the candidate (the other side exact), run the layer's causal attention (its own scale and
   sliding window) and measure the relative output error ‖o − ô‖² / ‖o‖², pooled over the windows.
2. **Allocation.** Units are (layer, side); a unit's cost is its candidate's all-in bytes per token. The
   greedy knapsack :func:`~bytediet.calibrate.mixed.choose_within_bytes` starts at the cheapest candidate
   everywhere and buys the upgrade with the largest error reduction per byte while the total fits
   ``bits × 2 × H × D × layers / 8`` bytes per token. The error is summed over layers and sides (additive
   approximation, as for the weights; HAWQ, arXiv 1905.03696). Then an exchange pass
   (:func:`~bytediet.calibrate.mixed.improve_by_exchange`) upgrades a unit beyond what fits by downgrading
   others where that lowers the summed error (at 8.5 bits: int8 in insensitive layers buys bf16 keys in the
   layer that needs them, which the greedy, stopping at q8_0 everywhere, cannot find).

3. **Validation.** The first half of every calibration window fits (steps 1–2), the second half validates: the
   plan and every *uniform* candidate within the budget (the same codec in every layer and side) score those tokens
   end to end, and the one of least mean KL(exact KV ‖ codec) of the logits is chosen — a plan never loses to one
   of its own candidates used alone (:func:`validate_proposals`).

Candidates with calibration hooks (TurboQuant: channel means, outlier channels, layout) are calibrated once, on the
fit tokens, before their errors are measured; their states travel with the plan (``states``). Which candidates there
are, and which half each may store: :mod:`bytediet.calibrate.kv_candidates`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..kvcache.base import get_kv_codec
from ..kvcache.split import half_of
from .base import Progress, no_progress
from .kv import capture_kv
from .kv_candidates import DEFAULT_CANDIDATES, candidate_roles, without_code_pages
from .mixed import choose_within_bytes, improve_by_exchange


@dataclass
class KVPlan:
    budget: float
    plan: list[dict]  # per layer {"k": spec, "v": spec}
    bits: float  # achieved all-in bits per coordinate
    errors: list[dict]  # per layer {"k": {spec: err}, "v": {spec: err}}
    estimated_error: float  # Σ of the chosen units' errors
    states: dict = field(default_factory=dict)  # spec → calibration state of the calibrated codecs used
    validation: dict = field(default_factory=dict)  # proposal → mean KL on the validation windows
    chosen: str = "plan"  # the proposal of least validation KL ("plan" or "uniform <spec>")
    estimated: dict = field(default_factory=dict)  # proposal → Σ per-layer attention error (the proxy)

    def state(self) -> dict:
        """The :class:`~bytediet.kvcache.auto.BudgetCodec` calibration state."""
        out = {"budget": self.budget, "plan": self.plan}
        if self.states:
            out["states"] = self.states
        return out

    def to_dict(self) -> dict:
        return {
            "budget": self.budget,
            "bits": self.bits,
            "plan": self.plan,
            "estimated_error": self.estimated_error,
            "errors": self.errors,
            "validation_kl": self.validation,
            "chosen": self.chosen,
            "calibrated": sorted(self.states),
            "estimated_error_by_proposal": self.estimated,
        }

    def verdict(self) -> str:
        """What the chosen proposal beat on validation, and by how much (mean KL)."""
        if not self.validation:
            return "not validated"
        best = self.validation[self.chosen]
        others = sorted((kl, name) for name, kl in self.validation.items() if name != self.chosen)
        beaten = ", ".join(f"{name} {kl:.4g} ({kl / max(best, 1e-30):.2f}×)" for kl, name in others[:4])
        return f"validation mean KL {best:.4g} ({self.chosen}); beat {beaten or 'nothing else within the budget'}"

    def summary(self) -> str:
        """One line per layer: ``layer 3: k=q8_0 (err 1.2e-04) v=q4_0 (err 3.1e-03)``."""
        lines = [f"KV plan for auto:{self.budget:g}: {self.bits:.3f} bits per coordinate all-in; {self.verdict()}"]
        for i, (p, e) in enumerate(zip(self.plan, self.errors)):
            lines.append(
                f"  layer {i:2d}: k={p['k']:<14} (err {e['k'][p['k']]:.2e})  v={p['v']:<14} (err {e['v'][p['v']]:.2e})"
            )
        return "\n".join(lines)


def _causal_attention(q, k, v, scale: float, window: Optional[int]) -> torch.Tensor:
    """q (L, Hq, D), k/v (L, Hkv, D) → (L, Hq, D), causal (and sliding-window) attention in float32."""
    n, hq, _ = q.shape
    group = hq // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))  # (Hq, L, D)
    pos = torch.arange(n)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale).transpose(0, 1)


def _stored_in_windows(
    codec, role: str, x: torch.Tensor, layer: int, positions: Optional[torch.Tensor]
) -> Optional[torch.Tensor]:
    """x (N, H, D) written into ``codec``'s K or V half and read back (at their ``positions`` where the pages
    use them: keys calibrated with a pre-RoPE mean); None if the half cannot take this shape."""
    half = half_of(codec, role)
    n, h, d = x.shape
    block = 16
    try:
        half.check(h, d, block)
        pages = half.create(layer, role, math.ceil(n / block), block, h, d, "cpu")
    except ConfigError:
        return None
    slots = torch.arange(n)
    if pages.uses_positions:
        pages.write(x.float(), slots, positions)
        return pages.decode(slots, positions)
    pages.write(x.float(), slots)
    return pages.decode(slots)


def layer_errors(
    sample: dict,
    lengths: Sequence[int],
    codecs: dict,
    layer: int,
    scale: float,
    window: Optional[int],
    roles: Optional[dict] = None,
) -> dict:
    """{"k": {spec: relative attention-output error}, "v": {...}} of one layer (candidates that fit);
    ``codecs``: spec → codec (calibrated where it has hooks); ``roles``: spec → the halves measured (default both,
    :func:`candidate_roles`)."""
    k, v, q = sample["k"], sample["v"], sample["q"]
    bounds = [0] + list(torch.tensor(list(lengths)).cumsum(0).tolist())
    ref = [_causal_attention(q[a:b], k[a:b], v[a:b], scale, window) for a, b in zip(bounds, bounds[1:])]
    den = sum(float(o.pow(2).sum()) for o in ref)
    out: dict = {"k": {}, "v": {}}
    for spec, codec in codecs.items():
        for role in (roles or {}).get(spec, ("k", "v")):
            stored = _stored_in_windows(codec, role, k if role == "k" else v, layer, sample.get("pos"))
            if stored is None:
                continue
            num = 0.0
            for (a, b), o in zip(zip(bounds, bounds[1:]), ref):
                kk, vv = (stored[a:b], v[a:b]) if role == "k" else (k[a:b], stored[a:b])
                num += float((_causal_attention(q[a:b], kk, vv, scale, window) - o).pow(2).sum())
            out[role][spec] = num / max(den, 1e-30)
    return out


def allocate(
    errors: list[dict], nbytes: dict[str, dict[str, float]], budget: float, num_kv_heads: int, head_dim: int
) -> list[dict]:
    """Per layer {"k": spec, "v": spec} minimising Σ error with mean all-in bits ≤ ``budget``.

    ``errors[i][role][spec]``: measured damage; ``nbytes[role][spec]``: bytes per token of that half."""
    units = {(i, role): dict(e[role]) for i, e in enumerate(errors) for role in ("k", "v")}
    for (i, role), table in units.items():
        if not table:
            raise ConfigError(f"no KV candidate can store layer {i}'s {role.upper()} (head_dim {head_dim})")
    cost = {u: {s: nbytes[u[1]][s] for s in units[u]} for u in units}
    max_bytes = budget * 2 * num_kv_heads * head_dim * len(errors) / 8
    cheapest = sum(min(c.values()) for c in cost.values()) * 8 / (2 * num_kv_heads * head_dim * len(errors))
    if cheapest > budget + 1e-12:
        raise ConfigError(
            f"the KV budget auto:{budget:g} is below what any codec reaches on this model "
            f"({cheapest:.3f} bits per coordinate all-in at least); raise the budget"
        )
    pick = choose_within_bytes(units, cost, max_bytes * (1 + 1e-12))
    pick = improve_by_exchange(pick, units, cost, max_bytes * (1 + 1e-12))
    return [{"k": pick[(i, "k")], "v": pick[(i, "v")]} for i in range(len(errors))]


def candidate_bytes(candidates: Sequence[str], num_kv_heads: int, head_dim: int) -> dict[str, dict[str, float]]:
    """{"k": {spec: bytes per token of its key half}, "v": {...}} (one layer) of the uncalibrated candidates; a
    candidate that cannot size this head dimension (TurboQuant 2.5 bits at head_dim 8) is left out, as
    :func:`layer_errors` leaves it out."""
    roles = candidate_roles(candidates)
    return _bytes_of({spec: get_kv_codec(spec) for spec in roles}, num_kv_heads, head_dim, roles)


def check_budget(budget: float, nbytes: dict, h: int, d: int) -> None:
    if not nbytes["k"] or not nbytes["v"]:
        raise ConfigError(f"no KV candidate of auto:{budget:g} can store head_dim {d}")
    cheapest = (min(nbytes["k"].values()) + min(nbytes["v"].values())) * 8 / (2 * h * d)
    if cheapest > budget + 1e-12:
        raise ConfigError(
            f"the KV budget auto:{budget:g} is below what any codec reaches on this model "
            f"({cheapest:.3f} bits per coordinate all-in at least); raise the budget"
        )


#: fewest tokens of each half of a calibration window (the first half fits the plan, the second validates it)
MIN_HALF_WINDOW = 16


def split_windows(windows: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(fit, validation): the first and second half of every calibration window (1-D token tensors)."""
    short = [len(w) for w in windows if len(w) < 2 * MIN_HALF_WINDOW]
    if len(windows) == 0 or short:
        raise ConfigError(
            f"KV calibration windows of {short[0] if short else 0} tokens are too short to split into a "
            f"fit and a validation half: give --kv-calib-len of at least {2 * MIN_HALF_WINDOW} "
            "(and --kv-calib-windows ≥ 1)"
        )
    return [w[: len(w) // 2] for w in windows], [w[len(w) // 2 :] for w in windows]


@dataclass
class Sensitivity:
    """One calibration pass: the per-layer error tables measured on the fit tokens, the candidates (calibrated
    where they have hooks) and the validation windows the final choice is scored on."""

    errors: list[dict]  # per layer {"k": {spec: error}, "v": {...}}
    codecs: dict  # spec → KVCodec, calibrated on the fit tokens where it has hooks
    validation: list[torch.Tensor]
    fit_tokens: int
    roles: dict = field(default_factory=dict)  # spec → the halves it is a candidate for (absent: both)

    def states(self, specs) -> dict:
        """The calibration states of ``specs`` that have one (what a plan using them must carry)."""
        from ..kvcache.state import to_plain

        out = {}
        for spec in sorted(set(specs)):
            state = self.codecs[spec].calibration_state()
            if state is not None:
                out[spec] = to_plain(state)
        return out


def calibrated_candidates(candidates: Sequence[str], samples: list[dict]) -> dict:
    """spec → codec, each candidate with calibration hooks calibrated on ``samples`` (:func:`capture_kv`)."""
    from .kv import calibrate_from_samples, has_calibration

    codecs = {}
    for spec in candidate_roles(candidates):
        codec = get_kv_codec(spec)
        codecs[spec] = calibrate_from_samples(codec, samples) if has_calibration(codec) else codec
    return codecs


def measure_errors(
    model,
    windows: Sequence[torch.Tensor],
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    progress: Progress = no_progress,
) -> Sensitivity:
    """The sensitivity tables (one pass serves every budget): capture K/V/Q on the first half of each window,
    calibrate the candidates that have hooks on it, measure every layer × side × candidate (on the Triton path,
    not the halves it has no kernel for: :func:`without_code_pages`)."""
    from ..kernels.backend import name_for

    fit, validation = split_windows(windows)
    samples = capture_kv(model, fit)
    roles = candidate_roles(candidates)
    codecs = calibrated_candidates(candidates, samples)
    if name_for(getattr(model, "device", "cpu")) == "triton":
        roles = without_code_pages(codecs, roles, model.config.num_kv_heads, model.config.head_dim)
    lengths = [len(w) for w in fit]
    errors = []
    for i in progress(range(model.config.num_layers), "KV budget: attention error per layer and codec"):
        attn = model.model.layers[i].self_attn
        errors.append(layer_errors(samples[i], lengths, codecs, i, attn.scale, attn.window, roles))
    return Sensitivity(errors, codecs, validation, sum(lengths), roles)


def _bytes_of(
    codecs: dict, num_kv_heads: int, head_dim: int, roles: Optional[dict] = None
) -> dict[str, dict[str, float]]:
    """{"k": {spec: bytes per token of its key half}, "v": {...}} of the (calibrated) candidates that size this head
    dimension, each for the halves ``roles`` gives it (default both)."""
    out: dict[str, dict[str, float]] = {"k": {}, "v": {}}
    for spec, codec in codecs.items():
        for role in (roles or {}).get(spec, ("k", "v")):
            try:
                out[role][spec] = half_of(codec, role).bytes_per_token(num_kv_heads, head_dim)
            except ConfigError:
                continue
    return out


def plan_from_errors(
    sens: Sensitivity, budget: float, num_kv_heads: int, head_dim: int, model=None, progress: Progress = no_progress
) -> KVPlan:
    """The plan for ``budget`` from measured tables (:func:`measure_errors`); with ``model``, validated against
    every uniform candidate within the budget on the validation windows (:func:`choose_validated`)."""
    nbytes = _bytes_of(sens.codecs, num_kv_heads, head_dim, sens.roles)
    plan = allocate(sens.errors, nbytes, budget, num_kv_heads, head_dim)
    per_coord = 8 / (2 * num_kv_heads * head_dim)
    bits = lambda p: sum(nbytes["k"][x["k"]] + nbytes["v"][x["v"]] for x in p) * per_coord / len(p)
    proposals = {"plan": plan}
    for spec in sens.codecs:  # the candidates every layer could store on both sides (their errors were measured)
        if all(spec in e["k"] and spec in e["v"] for e in sens.errors):
            uniform = [{"k": spec, "v": spec}] * len(plan)
            if bits(uniform) <= budget + 1e-9:
                proposals[f"uniform {spec}"] = uniform
    validation: dict[str, float] = {}
    chosen = "plan"
    if model is not None and len(proposals) > 1:
        validation = validate_proposals(model, sens, budget, proposals, progress)
        chosen = min(validation, key=lambda name: (validation[name], name != "plan"))
        plan = proposals[chosen]
    proxy = lambda p: sum(sens.errors[i]["k"][x["k"]] + sens.errors[i]["v"][x["v"]] for i, x in enumerate(p))
    specs = [x for p in plan for x in (p["k"], p["v"])]
    return KVPlan(
        budget,
        [dict(p) for p in plan],
        bits(plan),
        sens.errors,
        proxy(plan),
        sens.states(specs),
        validation,
        chosen,
        {name: proxy(p) for name, p in proposals.items()},
    )


def rank_correlation(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Spearman's ρ of two equally long samples (average ranks for ties); None below 3 points."""
    if len(xs) < 3:
        return None

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return torch.tensor(r, dtype=torch.float64)

    a, b = ranks(list(xs)), ranks(list(ys))
    a, b = a - a.mean(), b - b.mean()
    den = float(a.norm() * b.norm())
    return float(a @ b) / den if den > 0 else None


def validate_proposals(
    model, sens: Sensitivity, budget: float, proposals: dict, progress: Progress = no_progress
) -> dict[str, float]:
    """name → mean KL(exact KV ‖ proposal) of the next-token distributions over the validation windows, each
    proposal (per layer {"k", "v"}) run through the paged path as the engine would store it."""
    from ..kvcache.auto import BudgetCodec

    rope = getattr(model, "rope", None)
    out = {}
    for name, plan in progress(list(proposals.items()), f"KV budget auto:{budget:g}: validating the plan"):
        codec = BudgetCodec(budget)
        specs = [x for p in plan for x in (p["k"], p["v"])]
        codec.load_calibration_state({"budget": budget, "plan": plan, "states": sens.states(specs)}, rope=rope)
        total, count = 0.0, 0
        for w in sens.validation:
            kl, rows = _window_kl(model, w, codec)
            total, count = total + kl, count + rows
        out[name] = total / max(count, 1)
    return out


VALIDATION_ROW_ELEMENTS = 8 << 20  # logits compared at a time: 32 MiB of float32 per model (a 262k vocabulary: 32 rows)


def _window_kl(model, window: torch.Tensor, codec) -> tuple[float, int]:
    """(Σ KL(exact KV ‖ ``codec``) over the window's positions, positions): both runs scored a chunk of rows at a
    time (:meth:`~bytediet.models.transformer.CausalLM.score_rows`), so no window's logits exist whole."""
    n = window.numel()
    rows = max(1, VALIDATION_ROW_ELEMENTS // model.config.vocab_size)
    exact = model.score_rows(window, 0, n, rows, block_size=16)
    test = model.score_rows(window, 0, n, rows, kv_codec=codec, block_size=16)
    total = 0.0
    for (_, ref), (_, got) in zip(exact, test):
        ref, got = ref.float().log_softmax(dim=-1), got.float().log_softmax(dim=-1)
        total += float((ref.exp() * (ref - got)).sum())
    return total, n


def plan_kv_budget(
    model,
    windows: Sequence[torch.Tensor],
    budget: float,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    progress: Progress = no_progress,
) -> KVPlan:
    """Measure every layer × side × candidate on the fit half of ``windows`` (1-D token tensors), choose the plan
    and validate it on the other half."""
    h, d = model.config.num_kv_heads, model.config.head_dim
    check_budget(budget, candidate_bytes(candidates, h, d), h, d)  # fail before the forward passes
    return plan_from_errors(measure_errors(model, windows, candidates, progress), budget, h, d, model, progress)
