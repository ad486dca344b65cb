"""Sensitivity-driven mixed precision: per-block formats that meet a KL or perplexity budget at the fewest bytes.

1. Sensitivity: for every unit (each decoder block ``model.layers.i``, and ``lm_head``) and every
   candidate format, quantize that unit alone (round to nearest), run the calibration windows and
   measure the model's mean KL(reference ‖ quantized) per token, and its mean NLL increase, against
   the unquantized model. (HAWQ-style sensitivity by measurement; Dong et al. 2019, arXiv 1905.03696.)
2. Choice: start every unit at the cheapest candidate; estimate the total damage as the sum of the
   units' damages (additive approximation); while it exceeds the budget, apply the upgrade
   (unit → a more expensive candidate) with the largest damage reduction per extra byte (greedy by
   KL-per-byte, the usual knapsack heuristic).
3. Check: quantize the whole model with the choice and measure it. If the real damage is over
   budget (the units interact), the estimate's budget is tightened by budget / measured and step 2
   is repeated, at most ``rounds`` times; the last choice is returned either way, with its measurement.

Bytes come from each format's ``bits_per_weight`` (the same number the roofline uses). The result is
a :class:`~bytediet.models.quantize.QuantizeConfig`: the cheapest candidate as the format, one override per other unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..models.quantize import QuantizeConfig, build_format
from .base import Progress, no_progress

DEFAULT_CANDIDATES = ("int4-g32", "int8", "fp32")


@dataclass(frozen=True)
class MixedPrecisionConfig:
    """Candidates (any order) and exactly one budget: ``max_kl`` (nats/token) or ``max_ppl_increase`` (%)."""

    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    max_kl: Optional[float] = None
    max_ppl_increase: Optional[float] = None
    rounds: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidates", tuple(self.candidates))
        if (self.max_kl is None) == (self.max_ppl_increase is None):
            raise ConfigError("mixed precision needs exactly one budget: --max-kl or --max-ppl-increase")
        if (self.max_kl is not None and self.max_kl < 0) or (
            self.max_ppl_increase is not None and self.max_ppl_increase < 0
        ):
            raise ConfigError("the budget must be >= 0")
        if len(self.candidates) < 1:
            raise ConfigError("give at least one candidate format")
        for spec in self.candidates:
            build_format(spec)

    @property
    def metric(self) -> str:
        return "kl" if self.max_kl is not None else "nll"

    @property
    def budget(self) -> float:
        """In the metric's units: KL in nats/token, or the NLL increase log(1 + P/100)."""
        return self.max_kl if self.max_kl is not None else math.log1p(self.max_ppl_increase / 100)


class Scorer:
    """The unquantized model's next-token log-probabilities on the windows, and damage measurements against them."""

    def __init__(self, model, windows: torch.Tensor) -> None:
        self.windows = windows
        self.reference = [F.log_softmax(model.score(w).float(), -1).half() for w in windows]  # (L, vocab) each
        self.reference_nll = self._nll(self.reference)

    def _nll(self, logps) -> float:
        return sum(-lp[:-1].float().gather(1, w[1:, None]).sum().item() for lp, w in zip(logps, self.windows)) / sum(
            len(w) - 1 for w in self.windows
        )

    def measure(self, model) -> dict[str, float]:
        """{"kl": mean KL(ref ‖ model) per token, "nll": mean NLL increase per token}."""
        kl_sum, count, logps = 0.0, 0, []
        for w, ref in zip(self.windows, self.reference):
            lp = F.log_softmax(model.score(w).float(), -1)
            p = ref.float().exp()
            kl_sum += (p * (ref.float() - lp)).sum().item()
            count += len(w)
            logps.append(lp)
        return {"kl": kl_sum / count, "nll": self._nll(logps) - self.reference_nll}


def units_of(model) -> dict[str, dict[str, torch.nn.Module]]:
    """Unit name (the override pattern) → its linear layers: one per decoder block, and ``lm_head``."""
    units: dict[str, dict] = {}
    for name, layer in model.linear_layers():
        if name.startswith("model.layers."):
            key = "model.layers." + name.split(".")[2] + ".*"
        else:
            key = name
        units.setdefault(key, {})[name] = layer
    return units


@dataclass
class MixedResult:
    config: QuantizeConfig
    assignment: dict[str, str]
    sensitivity: dict[str, dict[str, float]]  # unit → candidate → damage (the chosen metric)
    estimated: float
    measured: dict[str, float]
    bytes: int
    rounds: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "format": self.config.format,
            "overrides": dict(self.config.overrides),
            "assignment": self.assignment,
            "sensitivity": self.sensitivity,
            "estimated": self.estimated,
            "measured": self.measured,
            "bytes": self.bytes,
            "rounds": self.rounds,
        }


def _install(units, assignment: dict[str, str], originals) -> None:
    for unit, spec in assignment.items():
        fmt = build_format(spec)
        for name, layer in units[unit].items():
            layer.set_weight(originals[name][0].dequantize(originals[name][1]), fmt)


def _restore(units, originals) -> None:
    for layers in units.values():
        for name, layer in layers.items():
            layer.set_packed(*originals[name])


def unit_bytes(units, spec: str) -> dict[str, int]:
    fmt = build_format(spec)
    return {
        u: int(
            sum(
                fmt.bits_per_weight(m.out_features, m.in_features) * m.out_features * m.in_features / 8
                for m in layers.values()
            )
        )
        for u, layers in units.items()
    }


def choose(
    sensitivity: dict[str, dict[str, float]], nbytes: dict[str, dict[str, int]], budget: float
) -> dict[str, str]:
    """Greedy: cheapest everywhere, then the best damage-reduction-per-byte upgrade until the estimate fits."""
    order = {u: sorted(c, key=lambda s: nbytes[u][s]) for u, c in sensitivity.items()}
    pick = {u: cands[0] for u, cands in order.items()}
    damage = lambda u, s: max(sensitivity[u][s], 0.0)  # a unit never helps the total
    while sum(damage(u, s) for u, s in pick.items()) > budget:
        best = None
        for u, cur in pick.items():
            for s in order[u][order[u].index(cur) + 1 :]:
                gain = damage(u, cur) - damage(u, s)
                extra = max(nbytes[u][s] - nbytes[u][cur], 1)
                if gain > 0 and (best is None or gain / extra > best[0]):
                    best = (gain / extra, u, s)
        if best is None:
            break  # nothing left that helps: the most precise choice is returned
        pick[best[1]] = best[2]
    return pick


def choose_within_bytes(
    damage: dict[str, dict[str, float]], nbytes: dict[str, dict[str, float]], max_bytes: float
) -> dict[str, str]:
    """The dual of :func:`choose`: the least total damage whose bytes fit ``max_bytes``.

    Greedy knapsack: cheapest candidate everywhere, then, while an upgrade fits, apply the one with the largest
    damage reduction per extra byte. Never exceeds ``max_bytes``; a budget below the cheapest choice is an error.
    """
    order = {u: sorted(c, key=lambda s: (nbytes[u][s], damage[u][s])) for u, c in damage.items()}
    pick = {u: cands[0] for u, cands in order.items()}
    spent = sum(nbytes[u][s] for u, s in pick.items())
    if spent > max_bytes:
        raise ConfigError(f"the budget ({max_bytes:g} bytes) is below the cheapest choice ({spent:g} bytes)")
    while True:
        best = None
        for u, cur in pick.items():
            for s in order[u][order[u].index(cur) + 1 :]:
                extra = nbytes[u][s] - nbytes[u][cur]
                gain = damage[u][cur] - damage[u][s]
                if gain > 0 and spent + extra <= max_bytes and (best is None or gain / max(extra, 1e-12) > best[0]):
                    best = (gain / max(extra, 1e-12), u, s, extra)
        if best is None:
            return pick
        pick[best[1]] = best[2]
        spent += best[3]


def improve_by_exchange(
    pick: dict[str, str],
    damage: dict[str, dict[str, float]],
    nbytes: dict[str, dict[str, float]],
    max_bytes: float,
    max_rounds: int = 64,
) -> dict[str, str]:
    """Local search after :func:`choose_within_bytes`: upgrade one unit beyond what fits, paying for it by
    downgrading others (the least damage per freed byte first), whenever the total damage falls.

    The greedy stops when no single upgrade fits; at a budget equal to one candidate everywhere (8.5 bits = q8_0
    in every layer) it cannot see that int8 in the insensitive layers buys bf16 for the one that matters. Never
    exceeds ``max_bytes``; returns a new plan (``pick`` is not changed).
    """
    pick = dict(pick)
    for _ in range(max_rounds):
        spent = sum(nbytes[u][s] for u, s in pick.items())
        downgrades = sorted(
            ((damage[v][t] - damage[v][cur]) / (nbytes[v][cur] - nbytes[v][t]), v, t)
            for v, cur in pick.items()
            for t in damage[v]
            if nbytes[v][t] < nbytes[v][cur]
        )
        best = None
        for u, cur in pick.items():
            for s in damage[u]:
                gain = damage[u][cur] - damage[u][s]
                need = spent + nbytes[u][s] - nbytes[u][cur] - max_bytes
                if gain <= 0 or need <= 0:
                    continue
                chosen, freed, cost = {}, 0.0, 0.0
                for _, v, t in downgrades:
                    if v == u or v in chosen:
                        continue
                    chosen[v] = t
                    freed += nbytes[v][pick[v]] - nbytes[v][t]
                    cost += damage[v][t] - damage[v][pick[v]]
                    if freed >= need:
                        break
                if freed >= need and gain - cost > 1e-15 and (best is None or gain - cost > best[0]):
                    best = (gain - cost, u, s, chosen)
        if best is None:
            return pick
        _, u, s, chosen = best
        pick[u] = s
        pick.update(chosen)
    return pick


def mixed_precision(
    model, windows: torch.Tensor, config: MixedPrecisionConfig, progress: Progress = no_progress
) -> MixedResult:
    """Measure per-unit sensitivity on ``windows`` (N, L), choose formats, verify; the model is left unchanged."""
    units = units_of(model)
    originals = {n: (layer.format, layer.packed) for layers in units.values() for n, layer in layers.items()}
    scorer = Scorer(model, windows)
    nbytes = {u: {} for u in units}
    for spec in config.candidates:
        for u, b in unit_bytes(units, spec).items():
            nbytes[u][spec] = b
    sensitivity = {u: {} for u in units}
    jobs = [(u, s) for u in units for s in config.candidates]
    try:
        for u, spec in progress(jobs, "mixed precision: sensitivity per block and format"):
            _install(units, {u: spec}, originals)
            sensitivity[u][spec] = scorer.measure(model)[config.metric]
            _restore(units, originals)
        budget, rounds = config.budget, []
        for _ in range(max(config.rounds, 1)):
            pick = choose(sensitivity, nbytes, budget)
            _install(units, pick, originals)
            measured = scorer.measure(model)
            _restore(units, originals)
            rounds.append({"estimate_budget": budget, "measured": measured})
            if measured[config.metric] <= config.budget or measured[config.metric] <= 0:
                break
            budget *= config.budget / measured[config.metric]
    finally:
        _restore(units, originals)
    estimated = sum(max(sensitivity[u][s], 0.0) for u, s in pick.items())
    base = min(config.candidates, key=lambda s: sum(nbytes[u][s] for u in units))
    overrides = {u: s for u, s in pick.items() if s != base or u in ("lm_head",)}
    qconfig = QuantizeConfig(format=base, overrides=overrides)
    return MixedResult(
        qconfig, pick, sensitivity, estimated, measured, sum(nbytes[u][s] for u, s in pick.items()), rounds
    )
