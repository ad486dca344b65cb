"""``--time-budget``: measure the candidates that fit in the time given, in order, and say which were skipped.

The steps already try candidates most promising first (the families of the quick preset in their registry
order, rounding before calibration, then KV codecs). Each measurement's cost is estimated from the last one of
its kind (a calibrated candidate or a KV byte budget first from three rounded ones); one whose estimate would end
inside the last :data:`RESERVE_FRACTION` of the budget is skipped and listed. The baseline is never skipped: a
budget that cannot hold it is refused once the profile has measured this machine's prefill speed
(:func:`baseline_seconds`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError
from .candidates import BUDGET_PREFIX

QUICK_SECONDS = 15 * 60  # --quick's default budget
CALIBRATED_OVER_ROUNDED = 3.0  # a calibrated candidate's first estimate, in rounded measurements
KV_PLAN = "kv-plan"
# the share of the budget kept back: for the report, the process's start, and estimates that run long (a KV codec
# that calibrates is estimated from one that does not: 28 s against 18 s on Qwen2.5-0.5B, session 15)
RESERVE_FRACTION = 0.03


def parse_duration(text: str) -> Optional[float]:
    """``90s``, ``15m``, ``1.5h`` or plain seconds → seconds; ``none`` → None (no budget)."""
    t = text.strip().lower()
    if t in ("none", "0"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smh]?)", t)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"--time-budget {text!r}: give a duration such as 90s, 15m or 1.5h (or none)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def kind_of(cand) -> str:
    """What a candidate's measurement costs like: ``baseline``, ``+<method>`` (calibrated), ``weights``, ``kv``,
    ``kv-plan`` (a KV byte budget: its per-layer sensitivity is measured before it)."""
    if cand.step == "baseline":
        return "baseline"
    if cand.method:
        return f"+{cand.method}"
    if cand.weights or cand.activations:
        return "weights"
    return KV_PLAN if (cand.kv or "").startswith(BUDGET_PREFIX) else "kv"


def calibrates(kind: str) -> bool:
    """Whether a measurement of ``kind`` calibrates first (its first estimate: rounded × CALIBRATED_OVER_ROUNDED)."""
    return kind.startswith("+") or kind == KV_PLAN


def baseline_seconds(profile: dict, settings) -> float:
    """Seconds the baseline takes at least: the reference and the test prefill of every evaluation window, at the
    prefill speed the profile measured."""
    tok_s = profile["phases"]["prefill"]["tok_s"]
    return 2 * settings.windows * (settings.window_len + 1) / tok_s


@dataclass
class TimeBudget:
    """``seconds`` for the whole run (None: no limit), counted from construction."""

    seconds: Optional[float]
    start: float = field(default_factory=time.perf_counter)
    costs: dict[str, float] = field(default_factory=dict)  # kind → seconds of its last measurement
    skipped: list[dict] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> Optional[float]:
        return None if self.seconds is None else self.seconds - self.elapsed()

    def estimate(self, kind: str) -> Optional[float]:
        """Seconds a measurement of ``kind`` should take, from the last of its kind (None: nothing to go by)."""
        if kind in self.costs:
            return self.costs[kind]
        rounded = self.costs.get("weights", self.costs.get("kv", self.costs.get("baseline")))
        if rounded is None:
            return None
        return rounded * CALIBRATED_OVER_ROUNDED if calibrates(kind) else rounded

    def allows(self, kind: str) -> bool:
        est = self.estimate(kind)
        if self.seconds is None or kind == "baseline" or est is None:
            return True
        return self.elapsed() + est + RESERVE_FRACTION * self.seconds <= self.seconds

    def record(self, kind: str, seconds: float) -> None:
        self.costs[kind] = seconds

    def skip(self, label: str, step: str, kind: str) -> None:
        self.skipped.append({"label": label, "step": step, "estimated_s": self.estimate(kind)})

    def check_baseline(self, needed: float) -> None:
        """Refuse a budget that cannot hold the baseline's ``needed`` seconds after what has run so far."""
        if self.seconds is not None and self.elapsed() + needed > self.seconds:
            raise ConfigError(
                f"--time-budget {self.seconds / 60:.1f} min cannot measure even the baseline: it needs "
                f"about {(self.elapsed() + needed) / 60:.1f} min on this machine (the unmodified model "
                "twice over the evaluation windows); give a larger --time-budget, or fewer / shorter "
                "windows (--windows, --window-len)"
            )

    def eta(self, kinds: list[str]) -> Optional[float]:
        """Seconds the measurements of ``kinds`` should take together (None: nothing to go by yet)."""
        ests = [self.estimate(k) for k in kinds]
        if any(e is None for e in ests):
            return None
        total = sum(ests)
        left = self.left()
        return total if left is None else min(total, max(left, 0.0))

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "elapsed_s": self.elapsed(), "skipped": list(self.skipped)}
