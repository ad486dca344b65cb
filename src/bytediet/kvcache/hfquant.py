"""Hugging Face ``QuantizedCache``'s scheme (transformers ``cache_implementation="quantized"``): spec
``hf<bits>[r<R>]``, bits ∈ {2, 4}, residual length R = 128 by default (HF's ``residual_length``).

What HF does (``transformers.cache_utils.QuantizedLayer``, after KIVI arXiv 2402.02750): the newest tokens
stay in full precision until ``residual_length`` of them exist; then they are quantized asymmetrically to
``nbits`` in groups of ``q_group_size`` = 64. Here, as the issue and HF's KV-cache blog describe it: **keys per
channel** (fp16 scale and zero per channel over 64 consecutive tokens) and **values per token** (fp16 scale and
zero per 64 channels), both behind the full-precision window of R tokens (:mod:`bytediet.kvcache.window`).

Difference, documented: HF re-quantizes the whole (dequantized) history with the new window each time the
window fills, so older tokens are quantized repeatedly; a paged cache quantizes each window once, which can
only be as good or better. The fp16 window is counted all-in: at R = 128 and one staged window per 2048 cache
tokens it costs 1 bit per coordinate on top of the codes and scales.

Attention: the native kernel reads these pages in place (code pages ``kivi<bits>-keys``, KIVI's per-channel layout,
and ``int<bits>-token-g64-asym``, ``kernels/cpu/csrc/code_pages.h``), rows of a window still open from its fp16
staging page (the slot's window indexes ``stage_of``); the numbers of the codec's own read. The one-call decode step
does not write these pages (it says so in one line; the module path runs, its attention native).
"""

from __future__ import annotations

import re

from ..errors import ConfigError
from .base import KV_CODECS
from .channelwise import ChannelwiseHalf
from .compressed import CompressedCodec
from .tokenwise import TokenwiseHalf
from .window import WindowHalf

Q_GROUP = 64
_SPEC = re.compile(r"^([24])(?:r(\d+))?$")


@KV_CODECS.register("hf")
class HFQuantizedCodec(CompressedCodec):
    def __init__(self, bits: int = 4, residual: int = 128) -> None:
        if bits not in (2, 4):
            raise ConfigError(f"hf (QuantizedCache) supports 2 or 4 bits, got {bits}")
        if residual < Q_GROUP or residual & (residual - 1):
            raise ConfigError(f"hf residual length must be a power of two >= {Q_GROUP}, got {residual}")
        keys = WindowHalf(ChannelwiseHalf(bits, Q_GROUP), residual)
        values = WindowHalf(TokenwiseHalf(bits, group=Q_GROUP, symmetric=False), residual)
        super().__init__(f"hf{bits}" + ("" if residual == 128 else f"r{residual}"), keys, values)

    @classmethod
    def from_spec(cls, rest: str) -> "HFQuantizedCodec":
        m = _SPEC.match(rest)
        if not m:
            raise ConfigError(f"bad spec 'hf{rest}': expected hf4, hf2 or hf<bits>r<residual> (e.g. hf4r64)")
        return cls(int(m.group(1)), int(m.group(2) or 128))
