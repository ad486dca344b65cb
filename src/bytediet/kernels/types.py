"""The ids shared with the native kernels, each named once with its explicit value.

Mirrored by ``cpu/csrc/types.h`` (one ``enum class`` per list); the library reports its own ids
(``bd_type_ids``) and ``tests/kernels/test_types.py`` checks the two agree. No id is a position in a list:
adding a member is one line here and one line there.
"""

from __future__ import annotations

from enum import IntEnum


class PageKind:
    """What a KV page type stores, which decides who reads and writes it."""

    ROW = "row"  # (slots, H, D) rows of one element type, read in place, written by the decode step
    TURBOQUANT = "turboquant"  # TurboQuant codes and norms (k_tq / v_tq), read and written on their codes
    BLOCK = "block"  # llama.cpp's GGML blocks of 32 values, D/32 blocks a row: read and written like rows
    CODE = "code"  # codes with side data (scales, zero points, transforms): read by the attention only


class KVPage(IntEnum):
    """A KV page type: the kernels' id, the codecs' name for it (``page_name``) and its :class:`PageKind`."""

    def __new__(cls, value: int, page_name: str, kind: str) -> "KVPage":
        member = int.__new__(cls, value)
        member._value_ = value
        member.page_name, member.kind = page_name, kind
        return member

    FP32 = 0, "fp32", PageKind.ROW
    BF16 = 1, "bf16", PageKind.ROW
    FP16 = 2, "fp16", PageKind.ROW
    INT8 = 3, "int8", PageKind.ROW  # code = round(x / scale) + 128, fp16 scale = amax / 127 per row
    FP8 = 4, "fp8", PageKind.ROW  # code = E4M3(x / scale), fp16 scale = amax / 448 per row
    TURBOQUANT = 5, "turboquant", PageKind.TURBOQUANT
    Q8_0 = 6, "q8_0", PageKind.BLOCK
    Q5_0 = 7, "q5_0", PageKind.BLOCK
    Q4_1 = 8, "q4_1", PageKind.BLOCK
    Q4_0 = 9, "q4_0", PageKind.BLOCK
    KIVI2_KEYS = 10, "kivi2-keys", PageKind.CODE
    KIVI4_KEYS = 11, "kivi4-keys", PageKind.CODE
    INT2_TOKEN_G32 = 12, "int2-token-g32-asym", PageKind.CODE
    INT4_TOKEN_G32 = 13, "int4-token-g32-asym", PageKind.CODE
    INT2_TOKEN_G64 = 14, "int2-token-g64-asym", PageKind.CODE
    INT4_TOKEN_G64 = 15, "int4-token-g64-asym", PageKind.CODE
    QJL1_KEYS = 16, "qjl1-keys", PageKind.CODE
    QJL2_KEYS = 17, "qjl2-keys", PageKind.CODE
    QJL3_KEYS = 18, "qjl3-keys", PageKind.CODE
    QJL4_KEYS = 19, "qjl4-keys", PageKind.CODE
    POLARQUANT = 20, "polarquant", PageKind.CODE
    Q5_1 = 21, "q5_1", PageKind.BLOCK

    @classmethod
    def named(cls, page_name: str) -> "KVPage":
        """The page type the codecs call ``page_name`` (``"q8_0"``, ``"kivi2-keys"`` …)."""
        for member in cls:
            if member.page_name == page_name:
                return member
        raise ValueError(f"no KV page type is named {page_name!r}; known: {', '.join(m.page_name for m in cls)}")


def page_names(kind: str) -> tuple[str, ...]:
    """The names of the page types of one :class:`PageKind`, in id order."""
    return tuple(m.page_name for m in KVPage if m.kind == kind)


class Activations(IntEnum):
    """How a linear layer's input rows reach the integer kernels (``gemm_blocks.cpp``; math in reference.py)."""

    def __new__(cls, value: int, mode_name: str) -> "Activations":
        member = int.__new__(cls, value)
        member._value_ = value
        member.mode_name = mode_name
        return member

    Q8 = 0, "q8"  # int8 codes, one scale per block of 32
    F32 = 1, "f32"  # float rows: codes widened to float in registers
    Q16 = 2, "q16"  # two int8 planes per block of 32 (≈ 16-bit)
    Q8_TOKEN = 3, "q8-token"  # int8 codes, one scale per row (int8-w8a8)

    @classmethod
    def named(cls, mode_name: str) -> "Activations":
        """The mode of ``ops.gemm_blocks``'s ``activations`` string."""
        for member in cls:
            if member.mode_name == mode_name:
                return member
        raise ValueError(f"activations must be one of {', '.join(m.mode_name for m in cls)}, got {mode_name!r}")


class WeightType(IntEnum):
    """A weight block layout the native GEMMs multiply: GGML's ids (``gguf.GGMLQuantizationType``), then
    bytediet's own layouts from 100 (``native_layouts.py``)."""

    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    INT8_ROW = 100
    INT4_G32_ASYM = 101  # asymmetric int4 groups: [scale f16][offset f16][codes], w = q·scale + offset
    INT4_G64_ASYM = 102
    INT4_G128_ASYM = 103
    INT4_G32_SYM = 104  # symmetric int4 groups: [scale f16][codes], w = (q − 8)·scale
    INT4_G64_SYM = 105
    INT4_G128_SYM = 106
    MXFP4_BLOCKS = 107
    NVFP4_BLOCKS = 108
    SPARSE24_INT8 = 109
    FP8_ROW = 110
    SPARSE24_F16 = 111


class Status(IntEnum):
    """What a native entry point returns (0: done); anything else means it did no work."""

    OK = 0
    UNSUPPORTED_PAGES = 1  # a layer's KV page types (or head_dim) that the decode step cannot read or write
    MISSING_PAGES = 2  # a layer's page data is missing (TurboQuant pages without their descriptor)


ENUMS = (KVPage, Activations, WeightType, Status)  # what bd_type_ids reports, by class name
