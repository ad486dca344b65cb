"""QJL KV cache (Zandieh, Daliri, Han; arXiv 2406.03482): spec ``qjl[<r>]``, sketch dimension m = r · head_dim.

Keys: a Gaussian JL sketch S ∈ R^{m×D} (i.i.d. N(0, 1), one per layer), stored as the m sign bits of S k
plus ‖k‖ in fp16. The query is sketched, not quantized, and the score uses the unbiased estimator

    ⟨q, k⟩ ≈ √(π/2) / m · ‖k‖ · ⟨S q, sign(S k)⟩          (paper, Lemma 3.2)

computed directly on the sign bits. Values: per-token asymmetric 4-bit, groups of 32 channels (fp16 scale
and zero point), as the paper pairs QJL keys with standard per-token value quantization.
r ∈ {1, 2, 3, 4} (default 2): keys cost r + 16/D bits per coordinate.

Attention: the native kernel reads both halves in place (``native_pages``: code pages ``qjl<r>-keys`` and
``int4-token-g32-asym``, ``kernels/cpu/csrc/code_pages.h``) for decodes and prefill chunks: S q once per query head and
call, then per key a sign-flipped sum of S q times √(π/2)/m · ‖k‖; no key is decoded. The calibrated mean's q·μ is the
same for every key of a query, so the softmax never sees it and the kernel leaves it out. The one-call decode step
does not write these pages (it says so in one line; the module path runs, its attention native).

**Calibration** (optional, :mod:`bytediet.calibrate.kv`): the per-layer channel mean μ (H, D) of the keys is
subtracted before sketching and its share q·μ added back to every score — exact, and it matters: the
estimator's error scales with ‖k‖, and on small models the mean carries a large part of the key energy
(37–68 % on SmolLM2, see ``bench/KV_RESULTS.md``). This is our stand-in for the paper's separate
treatment of outlier channels (§4). Without calibration no mean is used (documented fallback).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..errors import ConfigError
from ..kernels.decoder_spec import CodePageSide
from . import bitpack
from .base import KV_CODECS
from .compressed import CompressedCodec
from .halves import HalfCodec, HalfPages
from .rotation import gaussian_sketch
from .state import layer_map
from .tokenwise import TokenwiseHalf


class QJLKeyPages(HalfPages):
    def __init__(
        self, num_slots, num_heads, head_dim, device, sketch: torch.Tensor, mean: Optional[torch.Tensor] = None
    ) -> None:
        super().__init__(num_slots, num_heads, head_dim, device)
        self.S = sketch.to(device)  # (m, D)
        self.mean = None if mean is None else mean.to(device)  # (H, D) calibrated key mean, a constant
        self.m = sketch.shape[0]
        self.coef = math.sqrt(math.pi / 2) / self.m
        self.signs = torch.zeros(num_slots, num_heads, self.m // 8, dtype=torch.uint8, device=device)
        self.norm = torch.zeros(num_slots, num_heads, dtype=torch.float16, device=device)

    def write(self, x, slots):
        if self.mean is not None:
            x = x - self.mean
        self.signs.index_copy_(0, slots, bitpack.pack(((x @ self.S.T) >= 0).long(), 1))
        self.norm.index_copy_(0, slots, x.norm(dim=-1).to(torch.float16))

    def _pm1(self, slots: torch.Tensor) -> torch.Tensor:
        return bitpack.unpack(self.signs[slots], 1, self.m).float() * 2 - 1  # (L, H, m)

    def decode(self, slots):
        """The estimator's implied key μ + √(π/2)/m · ‖k − μ‖ · Sᵀ sign(S (k − μ)) (so scores = ⟨q, decode⟩)."""
        k = (self._pm1(slots) @ self.S) * (self.coef * self.norm[slots].float())[..., None]
        return k if self.mean is None else k + self.mean

    def prepare_query(self, qg):
        qmu = None if self.mean is None else torch.einsum("hgd,hd->hg", qg, self.mean)  # (H, G)
        return qg @ self.S.T, qmu  # (H, G, m)

    def scores(self, prepared, slots):
        sq, qmu = prepared
        signs = self._pm1(slots).transpose(0, 1)  # (H, L, m)
        norm = self.norm[slots].float().transpose(0, 1)  # (H, L)
        s = torch.bmm(sq, signs.transpose(1, 2)) * (self.coef * norm)[:, None, :]
        return s if qmu is None else s + qmu[..., None]

    def native_pages(self):
        """The sign bits and norms, scored on the codes by the native attention against the sketched query
        (``decoder_spec.CodePageSide``: norms as ``scale``, the sketch as ``transform``); the scores of :meth:`scores`
        less q·μ, which the softmax ignores."""
        if self.head_dim % 8 or self.m % self.head_dim:
            return None
        return f"qjl{self.m // self.head_dim}-keys", self.signs, None, CodePageSide(self.norm, transform=self.S)

    def tensors(self):
        return [self.signs, self.norm]


class QJLKeyHalf(HalfCodec):
    head_state = ("means",)  # per-KV-head calibration state, sliced per tensor-parallel rank

    def __init__(self, ratio: int) -> None:
        self.ratio = ratio
        self.name = f"qjl-keys-m{ratio}d"
        self.means: dict[int, torch.Tensor] = {}  # layer → (H, D) calibrated key mean

    def bytes_per_token(self, num_heads, head_dim):
        return num_heads * (self.ratio * head_dim / 8 + 2)

    def create(self, layer, role, num_blocks, block_size, num_heads, head_dim, device):
        sketch = gaussian_sketch(self.ratio * head_dim, head_dim, seed=31337 + layer)
        return QJLKeyPages(num_blocks * block_size, num_heads, head_dim, device, sketch, self.means.get(layer))

    def calibrate(self, samples: torch.Tensor, layer: int) -> None:
        """samples (N, H, D): this layer's keys on calibration text → their channel mean."""
        self.means[layer] = samples.float().reshape(-1, *samples.shape[-2:]).mean(0)

    def calibration_state(self):
        return {"means": dict(self.means)} if self.means else None

    def load_calibration_state(self, state, rope=None):
        self.means = layer_map(state["means"])


@KV_CODECS.register("qjl")
class QJLCodec(CompressedCodec):
    def __init__(self, ratio: int = 2) -> None:
        if ratio not in (1, 2, 3, 4):
            raise ConfigError(f"qjl sketch ratio m/head_dim must be 1, 2, 3 or 4, got {ratio}")
        super().__init__(f"qjl{ratio}", QJLKeyHalf(ratio), TokenwiseHalf(4, group=32, symmetric=False))

    @classmethod
    def from_spec(cls, rest: str) -> "QJLCodec":
        if rest and not rest.isdigit():
            raise ConfigError(f"bad QJL spec 'qjl{rest}': expected qjl or qjl<r> with r = m/head_dim in 1…4")
        return cls(int(rest) if rest else 2)
