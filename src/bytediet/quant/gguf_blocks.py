"""Native GGUF block formats kept packed: ``gguf-q4_0``, ``gguf-q4_1``, ``gguf-q5_0``, ``gguf-q5_1``,
``gguf-q8_0``, ``gguf-q4_k``, ``gguf-q5_k``, ``gguf-q6_k``.

The packed dict holds the tensor's raw GGML bytes, one row per output channel:
``{"blocks": (out_features, in_features / block_size · type_size) uint8}``; the GGML type is the
format itself and the shape follows from the bytes. The loader hands a GGUF tensor over unchanged with
:meth:`GGUFBlocks.from_gguf_tensor`, so a Q4_1 model runs at its native 5.0 bits per weight.
Decoding is bit-identical to ``gguf.quants.dequantize`` (see :mod:`bytediet.kernels.ggml_codecs`).

``apply`` runs the fused kernel :func:`bytediet.kernels.ops.gemm_blocks`, which reads the blocks in place.
``activations`` chooses how: ``"q8"`` quantizes the activation rows to int8 blocks and uses integer dot
products (llama.cpp's method; a small, measured accuracy cost), ``"q16"`` (the default) adds a second int8
plane for the rounding error (int16-like precision, twice the integer work, the same weight reads),
``"f32"`` keeps them in float. bench/RESULTS.md has the measured cost and speed of each.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import CheckpointError, ConfigError
from ..kernels import ops
from ..kernels.ggml_codecs import DECODERS, ENCODERS
from .base import WEIGHT_FORMATS, Packed, WeightFormat
from .common import NativeActivations, activations_only, check_block_cut, check_weight


class GGUFBlocks(NativeActivations, WeightFormat):
    """A GGML block type as a weight format; subclasses fix ``ggml_type``."""

    ggml_type: GGMLQuantizationType

    # the only option is the activation precision: "-a8" one int8 plane (llama.cpp's method), "-af32" float
    from_spec = classmethod(activations_only)

    def spec(self) -> str:
        return self.name + self.activation_suffix()

    def native_layout(self, packed: Packed):
        return int(self.ggml_type), packed["blocks"]

    def apply(self, x: torch.Tensor, packed: Packed, bias=None) -> torch.Tensor:
        return ops.gemm_blocks(int(self.ggml_type), packed["blocks"], x, bias, self.activations)

    @classmethod
    def block_size(cls) -> int:
        return GGML_QUANT_SIZES[cls.ggml_type][0]

    @classmethod
    def type_size(cls) -> int:
        return GGML_QUANT_SIZES[cls.ggml_type][1]

    @classmethod
    def can_quantize(cls) -> bool:
        """Whether :meth:`quantize` can encode a float weight (else the format only comes from GGUF files)."""
        return cls.ggml_type in ENCODERS

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        return 8.0 * self.type_size() / self.block_size()

    def quantize(self, weight: torch.Tensor, stats=None) -> Packed:
        if not self.can_quantize():
            encodable = ", ".join(f"gguf-{t.name.lower()}" for t in ENCODERS)
            raise ConfigError(
                f"{self.name}: quantizing float weights to {self.ggml_type.name} is not implemented; "
                f"load it from a GGUF file, or choose one of {encodable}"
            )
        w = check_weight(weight, self.name, self.block_size())
        out = w.shape[0]
        blocks = ENCODERS[self.ggml_type](w.reshape(-1, self.block_size()))
        return {"blocks": blocks.reshape(out, -1)}

    def dequantize(self, packed: Packed) -> torch.Tensor:
        raw = packed["blocks"]
        out, nbytes = raw.shape
        if nbytes % self.type_size():
            raise CheckpointError(f"{self.name}: {nbytes} bytes per row is not a whole number of blocks")
        values = DECODERS[self.ggml_type](raw.reshape(-1, self.type_size()))
        return values.reshape(out, -1)

    def shard(self, packed: Packed, dim: int, start: int, stop: int) -> Packed:
        """Rows are whole runs of blocks; columns can be cut only at block boundaries."""
        blocks = packed["blocks"]
        if dim == 0:
            return {"blocks": blocks[start:stop].contiguous()}
        bs, ts = self.block_size(), self.type_size()
        check_block_cut(self.name, start, stop, bs)
        return {"blocks": blocks[:, start // bs * ts : stop // bs * ts].contiguous()}

    def shape(self, packed: Packed) -> tuple[int, int]:
        """(out_features, in_features) of a packed weight."""
        out, nbytes = packed["blocks"].shape
        return out, nbytes // self.type_size() * self.block_size()

    @staticmethod
    def from_gguf_tensor(
        raw: np.ndarray, ggml_type: int | GGMLQuantizationType, shape: Sequence[int]
    ) -> tuple["GGUFBlocks", Packed]:
        """Wrap a GGUF tensor's bytes without decoding them.

        raw: the tensor's uint8 data (any shape, e.g. ``GGUFReader``'s ``tensor.data``); ``shape``: the
        PyTorch shape (out_features, in_features), i.e. the reverse of GGUF's ``ne`` order.
        Returns the format and its packed dict, ready for ``Linear.set_packed``.
        """
        gtype = GGMLQuantizationType(int(ggml_type))
        name = f"gguf-{gtype.name.lower()}"
        if name not in WEIGHT_FORMATS:
            kept = ", ".join(n for n in WEIGHT_FORMATS.names() if n.startswith("gguf-"))
            raise CheckpointError(f"GGML type {gtype.name} cannot be kept packed ({kept} can); dequantize it at load")
        fmt = WEIGHT_FORMATS.get(name)()
        out, k = (int(s) for s in shape)
        bs, ts = fmt.block_size(), fmt.type_size()
        if k % bs or raw.size != out * (k // bs) * ts:
            raise CheckpointError(
                f"{gtype.name} tensor of {raw.size} bytes does not match shape (out={out}, in={k}); "
                f"expected {out * (k // bs) * ts} bytes (is the shape in GGUF order? pass (out, in))"
            )
        data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(out, -1)
        return fmt, {"blocks": torch.from_numpy(data.copy())}


def _register(gtype: GGMLQuantizationType) -> type[GGUFBlocks]:
    name = f"gguf-{gtype.name.lower()}"
    cls = type(
        f"GGUF_{gtype.name}",
        (GGUFBlocks,),
        {
            "name": name,
            "ggml_type": gtype,
            "__doc__": f"GGML {gtype.name} blocks, kept packed.",
        },
    )
    return WEIGHT_FORMATS.register(name)(cls)


BLOCK_FORMATS = {t: _register(t) for t in DECODERS}
