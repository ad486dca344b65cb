"""vLLM's FP8 KV cache (``--kv-cache-dtype fp8``): E4M3 codes with **one scale per layer for K and one for V**.

vLLM stores ``k / k_scale`` and ``v / v_scale`` as ``float8_e4m3fn``; the two scales are per-tensor constants of
each attention layer. Without calibration they are 1.0 (vLLM's default; values beyond ±448 saturate); with
calibration (vLLM's ``--calculate-kv-scales``, here :mod:`bytediet.calibrate.kv` on calibration text) they are
amax / 448 over the layer's K (or V), all heads together. Exactly 8 bits per coordinate either way.

bytediet's own ``fp8`` differs: calibrated it keeps one scale per *head* (finer than vLLM's per-tensor), and
uncalibrated it falls back to a dynamic per-token, per-head fp16 scale (8 + 16/D bits), not a scale of 1.0.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .base import KV_CODECS
from .compressed import CompressedCodec
from .fp8 import E4M3_MAX, FP8Half, FP8Pages


class FP8TensorHalf(FP8Half):
    def __init__(self) -> None:
        super().__init__()
        self.name = "fp8-e4m3-per-tensor"

    def bytes_per_token(self, num_heads, head_dim):
        return num_heads * head_dim

    def create(self, layer, role, num_blocks, block_size, num_heads, head_dim, device):
        if self.scales and layer not in self.scales:
            raise ConfigError(f"fp8_vllm was calibrated for layers {sorted(self.scales)} but not layer {layer}")
        scale = self.scales.get(layer, torch.ones(1))
        return FP8Pages(num_blocks * block_size, num_heads, head_dim, device, scale.expand(num_heads).clone())

    def calibrate(self, samples: torch.Tensor, layer: int) -> None:
        amax = samples.float().abs().amax()
        self.scales[layer] = (amax / E4M3_MAX).clamp(min=1e-6).reshape(1)


@KV_CODECS.register("fp8_vllm")
class FP8VllmCodec(CompressedCodec):
    def __init__(self) -> None:
        super().__init__("fp8_vllm", FP8TensorHalf(), FP8TensorHalf())

    def calibrate(self, k_samples: torch.Tensor, v_samples: torch.Tensor, layer: int) -> None:
        """The per-tensor scales of ``layer`` from calibration keys/values, each (N, H, D)."""
        self.key_half.calibrate(k_samples, layer)
        self.value_half.calibrate(v_samples, layer)
