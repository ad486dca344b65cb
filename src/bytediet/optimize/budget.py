"""The accuracy budget and the choice of a configuration: pure functions of measured records.

A *record* is one measured configuration as a flat dict (see :func:`bytediet.optimize.recipe.record`)
with at least ``ppl_increase_pct`` (100·(PPL_test / PPL_ref − 1)), ``kl_mean`` (mean next-token
KL(P_ref || P_test) in nats), ``decode_tok_s`` and ``memory_bytes`` (weights + KV cache of one
sequence at the planning context).

* Within budget: ``ppl_increase_pct <= max_ppl_increase``, (when set) ``kl_mean <= max_kl``, and (when
  set and the record measured passkey retrieval) ``passkey_drop <= max_passkey_drop``: the fraction of
  passkey trials the reference retrieved and the configuration lost.
* Activation precision (a record measured by the ``activations`` step, with ``activation_ppl_cost`` and
  ``activation_top1_drop`` set): its cost *against the same weights at the default precision* must also stay
  within ``max_activation_ppl_cost`` percentage points of perplexity and ``max_activation_top1_drop`` of top-1
  agreement — the rule a faster default must meet (within +0.3 % perplexity and ≥ 99 % top-1 agreement of the
  precision it replaces, bench/RESULTS.md "Activation precision"), so a faster
  activation path is taken only when it costs almost nothing on top of the weight format chosen.
* Objective ``throughput``: the highest decode tok/s; ``memory``: the fewest bytes. Ties go to the
  smaller KL.
* Nothing within budget: the *closest* configuration is the one whose worst budget overshoot,
  as a multiple of its limit, is smallest (a 3% PPL increase under a 2% limit is 1.5×).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from ..errors import ConfigError

OBJECTIVES = ("throughput", "memory")


@dataclass(frozen=True)
class Budget:
    """How much accuracy the user will trade: PPL increase in percent, optionally mean KL in nats, and the
    passkey retrieval accuracy it may lose (a fraction; 0 = retrieve everything the unmodified model does)."""

    max_ppl_increase: float = 2.0
    max_kl: Optional[float] = None
    max_passkey_drop: Optional[float] = 0.0
    max_activation_ppl_cost: float = 0.3  # percentage points of PPL an activation precision may add
    max_activation_top1_drop: float = 0.01  # top-1 agreement it may lose (fraction)

    def __post_init__(self) -> None:
        if not self.max_activation_ppl_cost >= 0 or not 0.0 <= self.max_activation_top1_drop <= 1.0:
            raise ConfigError(
                "the activation-precision limits are a PPL cost in percentage points >= 0 and a "
                f"top-1 drop in [0, 1], got {self.max_activation_ppl_cost}, "
                f"{self.max_activation_top1_drop}"
            )
        if not self.max_ppl_increase >= 0:
            raise ConfigError(f"--max-ppl-increase is a percentage >= 0, got {self.max_ppl_increase}")
        if self.max_kl is not None and not self.max_kl >= 0:
            raise ConfigError(f"--max-kl is a KL divergence in nats >= 0, got {self.max_kl}")
        if self.max_passkey_drop is not None and not 0.0 <= self.max_passkey_drop <= 1.0:
            raise ConfigError(f"--max-passkey-drop is a fraction in [0, 1], got {self.max_passkey_drop}")

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        text = f"perplexity increase <= {self.max_ppl_increase:g}%"
        text += f", mean KL <= {self.max_kl:g} nats" if self.max_kl is not None else ""
        if self.max_passkey_drop is not None:
            text += f", passkey retrieval drop <= {self.max_passkey_drop:g}"
        text += (
            f"; a non-default activation precision adds <= {self.max_activation_ppl_cost:g} points of PPL "
            f"and loses <= {100 * self.max_activation_top1_drop:g}% top-1"
        )
        return text


def _passkey_drop(record: dict) -> Optional[float]:
    return record.get("passkey_drop")


def within(record: dict, budget: Budget) -> bool:
    """Whether ``record`` meets every limit of ``budget``."""
    if record["ppl_increase_pct"] > budget.max_ppl_increase:
        return False
    drop = _passkey_drop(record)
    if budget.max_passkey_drop is not None and drop is not None and drop > budget.max_passkey_drop + 1e-9:
        return False
    if not activation_cost_within(record, budget):
        return False
    return budget.max_kl is None or record["kl_mean"] <= budget.max_kl


def activation_cost_within(record: dict, budget: Budget) -> bool:
    """Whether an activation-precision record costs no more than the budget's activation limits over its parent
    (the same weights at the default precision); True for every other record."""
    cost, drop = record.get("activation_ppl_cost"), record.get("activation_top1_drop")
    if cost is None or drop is None:
        return True
    return cost <= budget.max_activation_ppl_cost + 1e-9 and drop <= budget.max_activation_top1_drop + 1e-9


def activation_cost(record: dict, parent: dict) -> dict:
    """The fields that make ``record`` (the weights of ``parent`` at another activation precision) an
    activation-precision record: its PPL cost in points and its top-1 loss against ``parent``."""
    return {
        "activation_parent": parent["label"],
        "activation_ppl_cost": record["ppl_increase_pct"] - parent["ppl_increase_pct"],
        "activation_top1_drop": parent["top1"] - record["top1"],
        "activation_speedup": record["decode_tok_s"] / parent["decode_tok_s"] if parent["decode_tok_s"] else None,
    }


def overshoot(record: dict, budget: Budget) -> float:
    """The worst limit ratio (value / limit) over the budget's limits: <= 1 inside the budget.

    A zero limit turns any positive value into ``inf`` (and 0 / 0 into 0)."""

    def ratio(value: float, limit: float) -> float:
        if limit > 0:
            return max(value, 0.0) / limit
        return 0.0 if value <= 0 else math.inf

    ratios = [ratio(record["ppl_increase_pct"], budget.max_ppl_increase)]
    if budget.max_kl is not None:
        ratios.append(ratio(record["kl_mean"], budget.max_kl))
    drop = _passkey_drop(record)
    if budget.max_passkey_drop is not None and drop is not None:
        ratios.append(ratio(drop - 1e-9, budget.max_passkey_drop))
    if record.get("activation_ppl_cost") is not None:
        ratios.append(ratio(record["activation_ppl_cost"] - 1e-9, budget.max_activation_ppl_cost))
        ratios.append(ratio(record["activation_top1_drop"] - 1e-9, budget.max_activation_top1_drop))
    return max(ratios)


def objective_key(record: dict, objective: str) -> tuple:
    """Sort key, best first: (objective, KL) — higher throughput or fewer bytes, then lower KL."""
    if objective == "throughput":
        return (-record["decode_tok_s"], record["kl_mean"])
    if objective == "memory":
        return (record["memory_bytes"], record["kl_mean"])
    raise ConfigError(f"unknown objective {objective!r}; choose one of: {', '.join(OBJECTIVES)}")


@dataclass(frozen=True)
class Choice:
    """The recommendation: ``record`` is None only when there were no records at all."""

    record: Optional[dict]
    within_budget: bool
    reason: str


def choose(records: Sequence[dict], budget: Budget, objective: str = "throughput") -> Choice:
    """The best record by ``objective`` within ``budget``; if none fits, the closest one (see module doc)."""
    objective_key({"decode_tok_s": 0.0, "memory_bytes": 0, "kl_mean": 0.0}, objective)  # validates the name
    if not records:
        return Choice(None, False, "nothing was measured")
    inside = [r for r in records if within(r, budget)]
    if inside:
        best = min(inside, key=lambda r: objective_key(r, objective))
        return Choice(
            best, True, f"best {objective} of {len(inside)} configuration(s) within the budget ({budget.describe()})"
        )
    closest = min(records, key=lambda r: (overshoot(r, budget), objective_key(r, objective)))
    return Choice(
        closest,
        False,
        f"no configuration meets the budget ({budget.describe()}); the closest is "
        f"{closest['label']} at {overshoot(closest, budget):.2f}x the limit — relax the budget "
        f"(e.g. --max-ppl-increase {_suggest(closest):g}) or accept more loss",
    )


def _suggest(record: dict) -> float:
    return math.ceil(max(record["ppl_increase_pct"], 0.0) * 10 + 1e-9) / 10


def best_of_step(records: Sequence[dict], budget: Budget, objective: str) -> Optional[dict]:
    """The winner of one technique (within budget), or None when none of its candidates fits."""
    inside = [r for r in records if within(r, budget)]
    return min(inside, key=lambda r: objective_key(r, objective)) if inside else None


def compounding(
    weights: dict, kv: dict, combined: dict, tolerance: float = 0.05, floors: tuple[float, float] = (1e-4, 0.05)
) -> dict:
    """Whether the errors of two techniques compound when applied together.

    Compares the combined mean KL and PPL increase with the sums of the parts (each part measured
    alone against the same reference). ``compounds`` is True when either combined value exceeds the
    sum of its parts by more than ``tolerance`` (relative) *and* by more than its noise floor
    (``floors``: KL in nats, PPL increase in percentage points) — the errors interact, not just add.
    """

    def verdict(a: float, b: float, both: float, floor: float) -> dict:
        total = max(a, 0.0) + max(b, 0.0)
        excess = both - total
        return {
            "parts": [a, b],
            "sum_of_parts": total,
            "combined": both,
            "excess": excess,
            "noise_floor": floor,
            "super_additive": excess > max(tolerance * total, floor),
        }

    kl = verdict(weights["kl_mean"], kv["kl_mean"], combined["kl_mean"], floors[0])
    ppl = verdict(weights["ppl_increase_pct"], kv["ppl_increase_pct"], combined["ppl_increase_pct"], floors[1])
    return {"kl_mean": kl, "ppl_increase_pct": ppl, "compounds": kl["super_additive"] or ppl["super_additive"]}
