"""Half codecs: how *one* of K or V is stored. A compressed KV codec is a key half plus a value half.

Splitting a codec in halves is what makes ``k=turboquant3,v=turboquant4`` possible and keeps each codec
file small: a half owns its page tensors, its bytes per token and its read path. The read path has hooks
so that a half can score or accumulate directly on its codes instead of decoding:

* keys:   ``prepare_query(qg)`` once per sequence and head group, then ``scores(prepared, slots)`` per chunk;
* values: ``weighted_sum(p, slots)`` per chunk in the half's own coordinates, ``finish(acc)`` once at the end.

The defaults decode one chunk to float32 (never the whole context) and use plain matmuls.

Shapes: H = KV heads, D = head dim, G = query rows per KV head (query heads per group × new tokens),
L = tokens in one chunk. ``qg``: (H, G, D); scores: (H, G, L); ``p``: (H, G, L).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any, Optional

import torch

from ..errors import ConfigError
from ..kernels.types import KVPage, PageKind


class HalfPages(ABC):
    """The pages of K (or V) of one layer: ``num_blocks * block_size`` slots × H heads × D.

    A half whose stored form depends on the token positions sets ``uses_positions``; it is then called as
    ``write(x, slots, positions)``, ``decode(slots, positions)`` and ``scores(prepared, slots, positions)``.
    """

    uses_positions = False
    rotation: Optional[torch.Tensor] = None  # (D, D): pages hold x Rᵀ (kvcache/rotated.py); None: x itself

    def __init__(self, num_slots: int, num_heads: int, head_dim: int, device) -> None:
        self.num_slots, self.num_heads, self.head_dim, self.device = num_slots, num_heads, head_dim, device

    @abstractmethod
    def write(self, x: torch.Tensor, slots: torch.Tensor) -> None:
        """x: (T, H, D) new tokens; slots: (T,) int64."""

    @abstractmethod
    def decode(self, slots: torch.Tensor) -> torch.Tensor:
        """(L,) slots → (L, H, D) float32 reconstruction (used for references and default reads)."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every per-slot tensor (what ``nbytes`` counts); per-layer constants such as rotations are not pages."""

    def max_sequences(self) -> Optional[int]:
        """See :meth:`bytediet.kvcache.base.LayerKVCache.max_sequences`."""
        return None

    def native_pages(self) -> Optional[tuple]:
        """(page type, codes (slots, H, D) — GGML block types: (slots, H, D/32 · block bytes) —, scales
        (slots, H, 1) float16 or None), or for code pages (``decoder_spec.CODE_PAGE_TYPES``: codes (slots, H,
        D·bits/8)) (page type, codes, None, their ``CodePageSide``), when the native attention reads these pages
        as they are stored (see ``LayerKVCache.native_pages``), else None."""
        return None

    def step_ready(self) -> bool:
        """See ``LayerKVCache.step_ready``."""
        return True

    def step_side(self) -> tuple[Optional[tuple], str]:
        """((page type, pages, scales, TurboQuant spec), "") as the native decode step reads and writes this half,
        or (None, why it cannot): it reads and writes row and block pages; code pages it only reads (attention)."""
        pages = self.native_pages()
        if pages is None:
            return None, f"{type(self).__name__} pages have no native read"
        if KVPage.named(pages[0]).kind not in (PageKind.ROW, PageKind.BLOCK):
            return None, (
                f"{pages[0]} pages are codes the native step does not write; the module path runs, its attention native"
            )
        return (pages[0], pages[1], pages[2], None), ""

    def prepare_query(self, qg: torch.Tensor) -> Any:
        return qg

    def scores(self, prepared: Any, slots: torch.Tensor) -> torch.Tensor:
        k = self.decode(slots).transpose(0, 1)  # (H, L, D)
        return torch.bmm(prepared, k.transpose(1, 2))  # (H, G, L)

    def weighted_sum(self, p: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return torch.bmm(p, self.decode(slots).transpose(0, 1))  # (H, G, D)

    def finish(self, acc: torch.Tensor) -> torch.Tensor:
        return acc


class HalfCodec(ABC):
    """Factory of :class:`HalfPages` plus the all-in size of one token's K (or V) in one layer."""

    name: str = "abstract"

    @abstractmethod
    def bytes_per_token(self, num_heads: int, head_dim: int) -> float:
        """All-in bytes of one token's K (or V) in one layer: codes, scales, norms, amortised bookkeeping."""

    @abstractmethod
    def create(
        self, layer: int, role: str, num_blocks: int, block_size: int, num_heads: int, head_dim: int, device
    ) -> HalfPages:
        """Allocate pages; ``role`` is ``"k"`` or ``"v"`` (seeds random transforms differently)."""

    def describe(self, head_dim: Optional[int] = None) -> str:
        """The half's name (see :meth:`bytediet.kvcache.base.KVCodec.describe`)."""
        return self.name

    def min_block_size(self) -> int:
        """The smallest block (tokens) this half can page (see :meth:`bytediet.kvcache.base.KVCodec.min_block_size`)."""
        return 1

    def check(self, num_heads: int, head_dim: int, block_size: int) -> None:  # noqa: B027 - optional hook
        """Raise ConfigError if this half cannot store vectors of this shape."""

    # attributes holding calibration state per KV head: {layer: (H, ...) tensor} or {layer: ((H, ...), extra)}
    head_state: tuple[str, ...] = ()

    def for_heads(self, lo: int, hi: int) -> "HalfCodec":
        """This half for KV heads ``[lo, hi)`` only (a tensor-parallel rank's): a copy whose per-head
        calibration state (:attr:`head_state`) is sliced; stateless halves return themselves."""
        if not self.head_state:
            return self
        out = copy.copy(self)
        for attr in self.head_state:
            setattr(out, attr, {layer: _head_slice(v, lo, hi) for layer, v in getattr(self, attr).items()})
        return out

    def calibration_state(self) -> Optional[dict]:
        """Plain data of what calibration taught this half (None: nothing); see :meth:`KVCodec.calibration_state`."""
        return None

    def load_calibration_state(self, state: dict, rope=None) -> None:
        if state:
            raise ConfigError(f"{self.name} takes no calibration state")


class FullPages(HalfPages):
    """Uncompressed storage in a float dtype (used for the full-precision half of split specs)."""

    def __init__(self, num_slots, num_heads, head_dim, device, dtype) -> None:
        super().__init__(num_slots, num_heads, head_dim, device)
        self.data = torch.zeros(num_slots, num_heads, head_dim, dtype=dtype, device=device)

    def write(self, x, slots):
        self.data.index_copy_(0, slots, x.to(self.data.dtype))

    def decode(self, slots):
        return self.data[slots].float()

    def native_pages(self):
        return _FLOAT_NAMES[self.data.dtype], self.data, None

    def tensors(self):
        return [self.data]


_FLOAT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # also the page type names


class FullHalf(HalfCodec):
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = _FLOAT_NAMES[dtype]

    def bytes_per_token(self, num_heads, head_dim):
        return num_heads * head_dim * torch.finfo(self.dtype).bits / 8

    def create(self, layer, role, num_blocks, block_size, num_heads, head_dim, device):
        return FullPages(num_blocks * block_size, num_heads, head_dim, device, self.dtype)


def _head_slice(value, lo: int, hi: int):
    """Heads ``[lo, hi)`` of a (H, ...) tensor, or of the first element of a (tensor, extra...) tuple."""
    if isinstance(value, tuple):
        return (value[0][lo:hi], *value[1:])
    return value[lo:hi]
