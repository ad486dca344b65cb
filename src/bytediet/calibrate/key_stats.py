"""Per-channel key magnitude statistics: which layers' keys have outlier channels, before and after RoPE.

A key codec that spends the same bits on every channel (q8_0, q4_0, KIVI's per-token groups) loses the small
channels when a few channels are tens of times larger; a rotation (``rot-*``, TurboQuant) spreads them first.
These numbers show which case a model is in. Keys are captured by :func:`bytediet.calibrate.kv.capture_kv`
(post-RoPE, as the cache stores them) and rotated back to pre-RoPE with the layer's own
:meth:`~bytediet.models.layers.RotaryEmbedding.inverse`.

For keys ``x`` (N tokens, H KV heads, D channels) of one layer, per head ``h`` and channel ``c``:
``rms[h, c] = sqrt(mean_t x[t, h, c]²)``; the layer's figures are the largest over its heads of

* ``max_median_ratio``: ``max_c rms / median_c rms``;
* ``top_share``: the share of the head's key energy ``Σ_c rms²`` in its largest ``D / 16`` channels (1/16 when flat);
* ``outliers``: channels with ``rms`` above ``threshold`` × the head's median (this one summed over the heads);
* ``kurtosis``: ``E[(x − x̄)⁴] / E[(x − x̄)²]²`` over all of the head's values (3 for a Gaussian);
* ``mean_share``: the share of the key energy in the per-channel means ``Σ_c x̄_c² / Σ_c rms²`` (an attention bias
  adds a constant to every pre-RoPE key);

and ``top_channel`` (head, channel) has the largest ``rms / median``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..errors import ConfigError
from .kv import capture_kv

TOP_FRACTION = 16  # top_share counts the largest D / 16 channels of a head
STATS = ("max_median_ratio", "top_share", "outliers", "kurtosis", "mean_share")


def channel_stats(keys: torch.Tensor, threshold: float = 4.0) -> dict:
    """The statistics above for keys (N, H, D) of one layer (float64 arithmetic)."""
    if keys.dim() != 3 or keys.shape[0] < 2:
        raise ConfigError(f"key statistics need keys of shape (tokens >= 2, heads, dim), got {tuple(keys.shape)}")
    x = keys.double()
    _, _, d = x.shape
    energy = x.pow(2).mean(0)  # (H, D)
    rms = energy.sqrt()
    median = torch.quantile(rms, 0.5, dim=1)  # (H,)
    ratio = rms / median.clamp_min(1e-30)[:, None]
    top = energy.topk(max(1, d // TOP_FRACTION), dim=1).values.sum(1) / energy.sum(1)
    mean = x.mean(0)
    centred = (x - x.mean(dim=(0, 2), keepdim=True)).transpose(0, 1).reshape(x.shape[1], -1)  # (H, N·D)
    kurtosis = centred.pow(4).mean(1) / centred.pow(2).mean(1).pow(2)
    head, channel = divmod(int(ratio.argmax()), d)
    return {
        "max_median_ratio": float(ratio.max()),
        "top_share": float(top.max()),
        "outliers": int((ratio > threshold).sum()),
        "kurtosis": float(kurtosis.max()),
        "mean_share": float((mean.pow(2).sum(1) / energy.sum(1)).max()),
        "top_channel": [head, channel],
    }


def _summary(layers: list[dict], side: str) -> dict:
    """Per statistic: the median over the layers that have ``side``, the largest and the layer that has it."""
    have = [layer for layer in layers if layer[side] is not None]
    out = {}
    for name in STATS:
        values = torch.tensor([float(layer[side][name]) for layer in have], dtype=torch.float64)
        worst = int(values.argmax())
        median = float(torch.quantile(values, 0.5))
        out[name] = {"median": median, "max": float(values[worst]), "max_layer": have[worst]["layer"]}
    return out


def key_stats(
    model, windows: Sequence[torch.Tensor], threshold: float = 4.0, max_samples: Optional[int] = None
) -> dict:
    """Run ``model`` over token ``windows`` (1-D LongTensors) → JSON-ready {"layers": [{"layer", "pre", "post"}],
    "summary": {"pre", "post"}, "tokens", "threshold", "top_fraction"}; ``pre`` is None for a layer without RoPE
    (and the summary has no ``pre`` when no layer has RoPE)."""
    layers = []
    samples = capture_kv(model, windows, max_samples)
    for i, s in enumerate(samples):
        pre = s["rope"].inverse(s["k"], s["pos"]) if s["rope"] is not None else None
        layers.append(
            {
                "layer": i,
                "pre": channel_stats(pre, threshold) if pre is not None else None,
                "post": channel_stats(s["k"], threshold),
            }
        )
    sides = ("pre", "post") if any(layer["pre"] is not None for layer in layers) else ("post",)
    return {
        "tokens": int(samples[0]["k"].shape[0]),
        "threshold": threshold,
        "top_fraction": 1 / TOP_FRACTION,
        "layers": layers,
        "summary": {side: _summary(layers, side) for side in sides},
    }
