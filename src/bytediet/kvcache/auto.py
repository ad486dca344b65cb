"""A KV byte budget instead of a codec name: spec ``auto:<bits>`` (e.g. ``auto:4.5``), average bits per coordinate
all-in (codes, scales, norms, windows — every codec's own ``bytes_per_token``).

The budget becomes a **plan** — per layer, a codec for the keys and one for the values — chosen by a calibration
pass that measures each layer's attention error under each candidate and allocates bytes where they buy the most
(:mod:`bytediet.calibrate.kv_budget`). The plan is this codec's calibration state, plain data that travels in
run configs::

    {"budget": 4.5, "plan": [{"k": "q8_0", "v": "q4_0"}, {"k": "turboquant4", "v": "q4_0"}, ...],
     "states": {"turboquant4": {...}}}

``states`` holds the calibration state of each calibrated codec the plan uses (TurboQuant's means and outlier
channels, fitted on the calibration text); a plan without it runs those codecs uncalibrated.

Layer ``i`` is stored by ``k=<plan[i].k>,v=<plan[i].v>`` (:mod:`bytediet.kvcache.split`). The block pool is sized
by the mean bytes per token over the layers, so the whole cache is exactly the plan's size. Without a plan the
codec cannot size anything and says how to get one; a plan over the budget is refused, never rounded.

Like ``k=…,v=…``, ``auto:<bits>`` is spec syntax (:func:`bytediet.kvcache.base.get_kv_codec`), not a registered
codec: it names no storage of its own, so the codec matrix does not run it (its layers are registered codecs).
"""

from __future__ import annotations

import re
from typing import Optional

from ..errors import ConfigError
from .base import KVCodec, LayerKVCache
from .split import split_codec

_SPEC = re.compile(r"^:(\d+(?:\.\d+)?)$")


class BudgetCodec(KVCodec):
    def __init__(self, budget: float) -> None:
        if budget <= 0:
            raise ConfigError(f"a KV budget must be positive bits per coordinate, got auto:{budget:g}")
        self.budget = budget
        self.name = f"auto:{budget:g}"
        self.plan: Optional[list[dict]] = None
        self.states: dict = {}  # spec → calibration state of the plan's calibrated codecs
        self.verdict: Optional[str] = None  # what the plan beat on validation, when it was just chosen
        self.layers: list[KVCodec] = []

    @classmethod
    def from_spec(cls, rest: str) -> "BudgetCodec":
        m = _SPEC.match(rest)
        if not m:
            raise ConfigError(f"bad KV budget 'auto{rest}': expected auto:<bits per coordinate>, e.g. auto:4.5")
        return cls(float(m.group(1)))

    # -- the plan is the calibration state ----------------------------------------------------------
    def calibration_state(self) -> Optional[dict]:
        if self.plan is None:
            return None
        out = {"budget": self.budget, "plan": [dict(p) for p in self.plan]}
        if self.states:
            out["states"] = self.states
        return out

    def load_calibration_state(self, state: dict, rope=None) -> None:
        from .base import get_kv_codec

        if float(state.get("budget", -1)) != self.budget:
            raise ConfigError(f"the KV plan was chosen for budget auto:{state.get('budget')}, not {self.name}")
        plan = state.get("plan")
        if (
            not isinstance(plan, list)
            or not plan
            or not all(isinstance(p, dict) and set(p) == {"k", "v"} for p in plan)
        ):
            raise ConfigError(f"{self.name}: the plan must be a list of {{'k': codec, 'v': codec}}, one per layer")
        states = state.get("states") or {}
        if not isinstance(states, dict):
            raise ConfigError(f"{self.name}: 'states' must map a codec spec to its calibration state")
        built: dict = {}

        def build(spec: str):  # one codec per spec, calibrated with its state from the plan where it has one
            if spec not in built:
                built[spec] = get_kv_codec(spec)
                if spec in states:
                    built[spec].load_calibration_state(states[spec], rope=rope)
            return built[spec]

        self.layers = [split_codec(f"k={p['k']},v={p['v']}", build) for p in plan]
        for i, codec in enumerate(self.layers):
            if codec.min_block_size() > 16:
                raise ConfigError(
                    f"{self.name}: layer {i}'s codec {codec.name} needs blocks of "
                    f"{codec.min_block_size()} tokens; plans use codecs that page 16-token blocks"
                )
        self.plan = [dict(p) for p in plan]
        self.states = dict(states)

    def _need_plan(self) -> None:
        if self.plan is None:
            raise ConfigError(
                f"{self.name} is a byte budget, not a codec: a calibration pass must choose the per-layer "
                "plan first (bytediet eval/generate/serve run it; in a run config give kv_calibration, "
                "or the plan itself as kv_calibration_state)"
            )

    # -- sizes and pages ------------------------------------------------------------------------------
    def layer_bits(self, num_kv_heads: int, head_dim: int) -> list[float]:
        """All-in bits per coordinate of each layer's K and V together."""
        self._need_plan()
        return [c.bits_per_coordinate(num_kv_heads, head_dim) for c in self.layers]

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float:
        self._need_plan()
        mean = sum(c.bytes_per_token(num_kv_heads, head_dim) for c in self.layers) / len(self.layers)
        bits = mean * 8 / (2 * num_kv_heads * head_dim)
        if bits > self.budget + 1e-9:
            raise ConfigError(
                f"the KV plan costs {bits:.4f} bits per coordinate at {num_kv_heads} KV heads × "
                f"head_dim {head_dim}, over the budget {self.name}; re-run the calibration for this model"
            )
        return mean

    def create_cache(self, layer, num_blocks, block_size, num_kv_heads, head_dim, dtype, device) -> LayerKVCache:
        self._need_plan()
        if layer >= len(self.layers):
            raise ConfigError(
                f"{self.name}: the plan covers {len(self.layers)} layers, the model has layer {layer}; "
                "re-run the calibration for this model"
            )
        self.bytes_per_token(num_kv_heads, head_dim)  # refuses a plan over the budget
        return self.layers[layer].create_cache(layer, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)

    def plan_table(self, num_kv_heads: int, head_dim: int) -> str:
        """The plan, one line per layer with its all-in bits (what ``generate``/``serve``/``eval`` print)."""
        bits = self.layer_bits(num_kv_heads, head_dim)
        mean = sum(bits) / len(bits)
        lines = [
            f"KV plan for {self.name}: {mean:.3f} bits per coordinate all-in"
            + (f"; {self.verdict}" if self.verdict else "")
        ]
        lines += [
            f"  layer {i:2d}: k={p['k']:<14} v={p['v']:<14} {b:.3f} bits"
            for i, (p, b) in enumerate(zip(self.plan, bits))
        ]
        return "\n".join(lines)

    def describe(self, head_dim: Optional[int] = None) -> str:
        if self.plan is None:
            return f"{self.name} [no plan yet]"
        counts: dict[str, int] = {}
        for p in self.plan:
            key = f"k={p['k']},v={p['v']}"
            counts[key] = counts.get(key, 0) + 1
        return f"{self.name} [" + "; ".join(f"{n}× {key}" for key, n in counts.items()) + "]"
