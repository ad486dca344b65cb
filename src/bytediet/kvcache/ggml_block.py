"""llama.cpp's KV-cache block types, each registered here: ``q8_0``, ``q5_1``, ``q5_0``, ``q4_1``, ``q4_0``
(``-ctk/-ctv``).

llama.cpp stores each cached K (or V) row of one head in GGML blocks of 32 consecutive channels along the
head dimension, per token: a block is an fp16 scale (and, for ``q5_1``/``q4_1``, an fp16 minimum) plus 32 codes, in
exactly the byte layout of ``ggml-common.h``. The block math is ``ggml-quants.c``'s reference quantizer,
bit for bit (:mod:`bytediet.kernels.ggml_codecs`, checked against ``gguf.quants``):

=======  ============  ===========================================  =====================
type     bytes / 32    element                                     bits per coordinate
=======  ============  ===========================================  =====================
q8_0     34            d · q,  d = absmax / 127, q ∈ [−127, 127]    8.5
q5_0     22            d · (q − 16), d = signed absmax / −16         5.5
q5_1     24            d · q + m, d = (max − min) / 31, m = min      6.0
q4_1     20            d · q + m, d = (max − min) / 15, m = min      5.0
q4_0     18            d · (q − 8),  d = signed absmax / −8          4.5
=======  ============  ===========================================  =====================

Pages: (slots, H, D/32 · bytes) uint8, the GGML blocks themselves; nothing else is stored, so the all-in bits
per coordinate are the table's. The head dimension must be a multiple of 32 (llama.cpp's own requirement).
The native attention reads these pages in place, for keys and values alike and beside any other page type it
reads (``k=q8_0,v=q4_0``, ``k=bf16,v=q4_1``): ``kernels/cpu/csrc/kv_pages.h``.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from ..errors import ConfigError
from ..kernels.decoder_spec import BLOCK_PAGE_TYPES
from ..kernels.ggml_codecs import DECODERS, ENCODERS
from .base import KV_CODECS
from .compressed import CompressedCodec
from .halves import HalfCodec, HalfPages

QK = 32
TYPES = BLOCK_PAGE_TYPES  # name → GGML type: q8_0, q5_0, q4_1, q4_0 (the native attention's page type names)
TYPE_BYTES = {T.Q8_0: 34, T.Q5_0: 22, T.Q4_1: 20, T.Q4_0: 18, T.Q5_1: 24}


class GGMLBlockPages(HalfPages):
    def __init__(self, num_slots, num_heads, head_dim, device, name: str) -> None:
        super().__init__(num_slots, num_heads, head_dim, device)
        self.name, self.ggml_type = name, TYPES[name]
        self.type_bytes = TYPE_BYTES[self.ggml_type]
        self.blocks = torch.zeros(
            num_slots, num_heads, head_dim // QK * self.type_bytes, dtype=torch.uint8, device=device
        )

    def write(self, x, slots):
        t, h, d = x.shape
        b = ENCODERS[self.ggml_type](x.float().reshape(-1, QK).contiguous())  # (t·h·d/32, bytes)
        self.blocks.index_copy_(0, slots, b.reshape(t, h, -1))

    def decode(self, slots):
        n = slots.shape[0]
        b = self.blocks[slots].reshape(-1, self.type_bytes)
        return DECODERS[self.ggml_type](b).reshape(n, self.num_heads, self.head_dim)

    def native_pages(self):
        return self.name, self.blocks, None

    def tensors(self):
        return [self.blocks]


class GGMLBlockHalf(HalfCodec):
    """One of K or V in a llama.cpp block type (``name`` one of :data:`TYPES`)."""

    def __init__(self, name: str) -> None:
        self.name, self.ggml_type = name, TYPES[name]

    def bytes_per_token(self, num_heads, head_dim):
        return num_heads * head_dim / QK * TYPE_BYTES[self.ggml_type]

    def create(self, layer, role, num_blocks, block_size, num_heads, head_dim, device):
        if head_dim % QK:
            raise ConfigError(
                f"{self.name}: layer {layer} has head_dim {head_dim}, not a multiple of {QK} "
                "(llama.cpp's block); choose another KV codec for this model"
            )
        return GGMLBlockPages(num_blocks * block_size, num_heads, head_dim, device, self.name)


def ggml_codec_class(name: str):
    """A codec class storing K and V both in the llama.cpp type ``name`` (registered below, one per type)."""

    class GGMLCodec(CompressedCodec):
        __doc__ = (
            f"llama.cpp's ``{name}`` KV cache (``-ctk {name} -ctv {name}``); see :mod:`bytediet.kvcache.ggml_block`."
        )

        def __init__(self) -> None:
            super().__init__(name, GGMLBlockHalf(name), GGMLBlockHalf(name))

    GGMLCodec.__name__ = GGMLCodec.__qualname__ = name.upper().replace("_", "") + "Codec"
    return GGMLCodec


for _name in TYPES:  # q8_0, q5_0, q4_1, q4_0, q5_1: llama.cpp's -ctk/-ctv names
    KV_CODECS.register(_name)(ggml_codec_class(_name))
