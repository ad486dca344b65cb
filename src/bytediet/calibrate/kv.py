"""Calibration of KV codecs from real text: capture every layer's K, V (and Q) by running the model.

Some codecs need per-layer constants taken from calibration data, never from the text they are
evaluated on: FP8's static per-head scales, TurboQuant's outlier channels, key/value channel means and
channel weights. :func:`capture_kv` runs the model over calibration token windows with a capture cache
that records the post-RoPE keys, values and queries each attention layer sees; :func:`calibrate_codec`
hands them to every half of a codec that has a ``calibrate`` hook.

    from bytediet.eval.corpus import calibration_windows
    windows = calibration_windows(tokenizer, CalibrationConfig(samples=2, seq_len=1024), bos=False)
    codec = calibrate_codec(get_kv_codec("turboquant3.5"), model, windows)
    logits = model.score(eval_ids, kv_codec=codec)

A half's hook is ``calibrate(samples (N, H, D), layer)``; key halves may also accept ``queries=`` (N, Hq, D)
to weight channels by how much the queries read them, and ``positions=`` (N,) with ``rope=`` (the layer's
:class:`~bytediet.models.layers.RotaryEmbedding`) to see the keys before RoPE.
"""

from __future__ import annotations

import inspect
import math
from typing import Optional, Sequence

import torch

from ..errors import ConfigError
from ..kvcache import AttentionMetadata, KVCodec, LayerKVCache
from ..kvcache.auto import BudgetCodec
from ..kvcache.full import FullPrecisionCache


class CaptureCache(LayerKVCache):
    """A float32 cache that also keeps every written K, V and every attending Q (for calibration only)."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device) -> None:
        self.inner = FullPrecisionCache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32, device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.q: list[torch.Tensor] = []
        self.pos: list[torch.Tensor] = []

    def write(self, k, v, slot_mapping, positions=None):
        self.k.append(k.detach().float().cpu())
        self.v.append(v.detach().float().cpu())
        self.pos.append((positions if positions is not None else torch.full((k.shape[0],), -1)).detach().long().cpu())
        self.inner.write(k, v, slot_mapping, positions)

    def attend(self, q, meta, scale, window=None):
        self.q.append(q.detach().float().cpu())
        return self.inner.attend(q, meta, scale, window)


def capture_kv(model, windows: Sequence[torch.Tensor], max_samples: Optional[int] = None) -> list[dict]:
    """Run ``model`` over each token window (1-D LongTensors) → per layer {"k", "v": (N, Hkv, D), "q": (N, Hq, D),
    "pos": (N,) each token's position, "rope": the layer's rotary embedding (None if the model has none)}.

    Samples are float32 on the CPU, concatenated over windows; ``max_samples`` keeps an evenly spaced subset.
    """
    if len(windows) == 0:
        raise ConfigError(
            "KV calibration needs at least one token window (see bytediet.eval.corpus.calibration_windows)"
        )
    cfg = model.config
    block_size = 16
    per_layer = [{"k": [], "v": [], "q": [], "pos": []} for _ in range(cfg.num_layers)]
    for ids in windows:
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(model.device)
        n = ids.shape[0]
        caches = [
            CaptureCache(math.ceil(n / block_size), block_size, cfg.num_kv_heads, cfg.head_dim, model.device)
            for _ in range(cfg.num_layers)
        ]
        model.forward(
            ids,
            AttentionMetadata.for_single_sequence(n, block_size, model.device),
            caches,
            logits_indices=torch.tensor([n - 1], device=model.device),
        )
        for store, cache in zip(per_layer, caches):
            for key in ("k", "v", "q", "pos"):
                store[key] += getattr(cache, key)
    out = []
    for i, store in enumerate(per_layer):
        layer = {key: torch.cat(store[key]) for key in ("k", "v", "q", "pos")}
        if max_samples is not None and layer["k"].shape[0] > max_samples:
            keep = torch.linspace(0, layer["k"].shape[0] - 1, max_samples).long()
            layer = {key: t[keep] for key, t in layer.items()}
        layer["rope"] = model.rope(i) if hasattr(model, "rope") else None
        out.append(layer)
    return out


def _call(hook, samples: torch.Tensor, layer: int, **extra) -> None:
    """``hook(samples, layer, **extra)`` with only the extras (queries, positions, rope) the hook accepts."""
    accepted = inspect.signature(hook).parameters
    hook(samples, layer, **{k: v for k, v in extra.items() if v is not None and k in accepted})


def calibrate_from_samples(codec: KVCodec, samples: list[dict]) -> KVCodec:
    """Feed captured per-layer samples (from :func:`capture_kv`) to the codec's calibration hooks."""
    halves = [(getattr(codec, "key_half", None), "k"), (getattr(codec, "value_half", None), "v")]
    hooks = [(h.calibrate, role) for h, role in halves if h is not None and hasattr(h, "calibrate")]
    if not hooks and hasattr(codec, "calibrate"):
        for layer, s in enumerate(samples):
            codec.calibrate(s["k"], s["v"], layer)
        return codec
    for layer, s in enumerate(samples):
        for hook, role in hooks:
            if role == "k":  # keys are read by queries and carry RoPE; values have neither
                _call(hook, s["k"], layer, queries=s["q"], positions=s.get("pos"), rope=s.get("rope"))
            else:
                _call(hook, s["v"], layer)
    return codec


def has_calibration(codec: KVCodec) -> bool:
    """Whether ``codec`` (or one of its key/value halves) has a calibration hook, or is a budget to plan."""
    return (
        isinstance(codec, BudgetCodec)
        or hasattr(codec, "calibrate")
        or any(hasattr(getattr(codec, h, None), "calibrate") for h in ("key_half", "value_half"))
    )


def needs_calibration(codec: KVCodec) -> bool:
    """Whether ``codec`` must be calibrated to be usable: a budget (its plan), or a codec or half that says so
    (TurboQuant: without a channel mean and calibrated outlier channels, keys with outliers can collapse)."""
    parts = (codec, getattr(codec, "key_half", None), getattr(codec, "value_half", None))
    return isinstance(codec, BudgetCodec) or any(getattr(p, "needs_calibration", False) for p in parts)


def calibrate_codec(
    codec: KVCodec, model, windows: Sequence[torch.Tensor], max_samples: Optional[int] = 8192
) -> KVCodec:
    """Capture K/V/Q on ``windows`` and calibrate ``codec`` in place (returned for chaining).

    Codecs without any calibration hook are returned unchanged. A budget (``auto:<bits>``) gets its per-layer
    plan (:func:`bytediet.calibrate.kv_budget.plan_kv_budget`, on the same windows).
    """
    if isinstance(codec, BudgetCodec):
        from .kv_budget import plan_kv_budget

        plan = plan_kv_budget(model, windows, codec.budget)
        codec.load_calibration_state(plan.state(), rope=getattr(model, "rope", None))
        codec.verdict = plan.verdict()
        return codec
    if not has_calibration(codec):
        return codec
    return calibrate_from_samples(codec, capture_kv(model, windows, max_samples))
