"""FP8 (E4M3) KV cache with a per-head scale.

Calibrated (``codec.calibrate(k_samples, v_samples, layer)`` for every layer, samples (N, H, D) taken
from calibration text): one static scale per layer, K/V and head = amax / 448, stored as a per-layer
constant, so a token costs exactly 8 bits per coordinate. Values beyond the calibrated range saturate at
±448·scale (E4M3 has no infinity).

**Fallback when uncalibrated:** a dynamic per-token, per-head scale (fp16), 8 + 16/D bits per coordinate.
The choice is made by the codec (all layers alike), so ``bytes_per_token`` stays one number.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import ConfigError
from .base import KV_CODECS
from .compressed import CompressedCodec
from .halves import HalfCodec, HalfPages
from .state import layer_map

E4M3_MAX = 448.0


class FP8Pages(HalfPages):
    def __init__(self, num_slots, num_heads, head_dim, device, static_scale: Optional[torch.Tensor]) -> None:
        super().__init__(num_slots, num_heads, head_dim, device)
        self.codes = torch.zeros(num_slots, num_heads, head_dim, dtype=torch.uint8, device=device)
        self.static_scale = None if static_scale is None else static_scale.to(device)  # (H,)
        self.scale = (
            None if static_scale is not None else torch.zeros(num_slots, num_heads, dtype=torch.float16, device=device)
        )

    def _scales(self, slots: torch.Tensor) -> torch.Tensor:
        """(L, H, 1) float32 scale of each stored token."""
        if self.static_scale is not None:
            return self.static_scale[None, :, None].expand(len(slots), -1, -1)
        return self.scale[slots].float()[..., None]

    def write(self, x, slots):
        if self.static_scale is None:
            scale = (x.abs().amax(-1) / E4M3_MAX).clamp(min=1e-6).to(torch.float16)
            self.scale.index_copy_(0, slots, scale)
            s = scale.float()[..., None]
        else:
            s = self.static_scale[None, :, None]
        f8 = (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        self.codes.index_copy_(0, slots, f8.view(torch.uint8))

    def decode(self, slots):
        return self.codes[slots].view(torch.float8_e4m3fn).float() * self._scales(slots)

    def native_pages(self):
        return None if self.scale is None else ("fp8", self.codes, self.scale)  # static scales: module path

    def tensors(self):
        return [self.codes] + ([] if self.scale is None else [self.scale])


class FP8Half(HalfCodec):
    head_state = ("scales",)  # per-KV-head calibration state, sliced per tensor-parallel rank

    def __init__(self) -> None:
        self.name = "fp8-e4m3"
        self.scales: dict[int, torch.Tensor] = {}  # layer → (H,) static scale

    def bytes_per_token(self, num_heads, head_dim):
        return num_heads * (head_dim + (0 if self.scales else 2))

    def create(self, layer, role, num_blocks, block_size, num_heads, head_dim, device):
        if self.scales and layer not in self.scales:
            raise ConfigError(
                f"fp8 KV cache was calibrated for layers {sorted(self.scales)} but not layer {layer}; "
                "calibrate every layer (or none, for dynamic per-token scales)"
            )
        return FP8Pages(num_blocks * block_size, num_heads, head_dim, device, self.scales.get(layer))

    def calibrate(self, samples: torch.Tensor, layer: int) -> None:
        amax = samples.float().abs().reshape(-1, *samples.shape[-2:]).amax(dim=(0, 2))  # (H,)
        self.scales[layer] = (amax / E4M3_MAX).clamp(min=1e-6)

    def calibration_state(self):
        return {"scales": dict(self.scales)} if self.scales else None

    def load_calibration_state(self, state, rope=None):
        self.scales = layer_map(state["scales"])


@KV_CODECS.register("fp8")
class FP8Codec(CompressedCodec):
    def __init__(self) -> None:
        super().__init__("fp8", FP8Half(), FP8Half())

    @classmethod
    def from_spec(cls, rest: str) -> "FP8Codec":
        if rest not in ("", "_e4m3", "e4m3"):
            raise ConfigError(f"unknown fp8 variant 'fp8{rest}'; only E4M3 ('fp8') is supported")
        return cls()

    @property
    def calibrated(self) -> bool:
        return bool(self.key_half.scales)

    def calibrate(self, k_samples: torch.Tensor, v_samples: torch.Tensor, layer: int) -> None:
        """Static per-head scales for ``layer`` from calibration keys/values, each (N, H, D)."""
        self.key_half.calibrate(k_samples, layer)
        self.value_half.calibrate(v_samples, layer)
