"""The ctypes mirrors of the structs Python hands the native library, and the check that they match it.

Each mirror names its C++ struct (csrc/decoder.h, turboquant_pages.h, code_pages.h). The library reports every
struct's size and field offsets (``bd_struct_layout``); :func:`check` compares them with the mirrors when the
library loads, so a field moved on one side fails loudly instead of reading garbage.
"""

from __future__ import annotations

import ctypes
from typing import Mapping

_PTR, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class ABIError(RuntimeError):
    """The native library's structs do not match their ctypes mirrors (a bug: change both together)."""


class LinearDesc(ctypes.Structure):
    _fields_ = [
        ("blocks", _PTR),
        ("bias", _PTR),
        ("n", _I64),
        ("k", _I64),
        ("ggml_type", _I32),
        ("interleaved", _I32),
        ("source", _PTR),
    ]


# LayerDesc's tensor pointers and linear layers, in field order (named after LayerSpec's fields)
LAYER_TENSORS = (
    "attn_norm",
    "post_attn_norm",
    "pre_ffn_norm",
    "post_ffn_norm",
    "q_norm",
    "k_norm",
    "inv_freq",
    "k_cache",
    "v_cache",
)
LAYER_LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


class LayerDesc(ctypes.Structure):
    _fields_ = (
        [(name, _PTR) for name in LAYER_TENSORS]
        + [(name, LinearDesc) for name in LAYER_LINEARS]
        + [
            ("window", _I64),
            ("k_scale", _PTR),
            ("v_scale", _PTR),
            ("k_dtype", _I32),
            ("v_dtype", _I32),
            ("k_tq", _PTR),
            ("v_tq", _PTR),
            ("k_rot", _PTR),
            ("v_rot", _PTR),
        ]
    )


class ModelDesc(ctypes.Structure):
    _fields_ = (
        [("layers", ctypes.POINTER(LayerDesc))]
        + [(name, _I64) for name in ("num_layers", "hidden", "intermediate", "num_heads", "num_kv_heads", "head_dim")]
        + [
            ("eps", _F32),
            ("attention_scale", _F32),
            ("gelu", _I32),
            ("sandwich", _I32),
            ("activations", _I32),
            ("pad", _I32),
        ]
    )


class TQPartDesc(ctypes.Structure):
    _fields_ = (
        [(name, _PTR) for name in ("rotation", "codebook", "norm", "idx")]
        + [("dim", _I64), ("bits", _I32), ("pad", _I32)]
        + [(name, _PTR) for name in ("signs", "res_norm", "sketch")]
    )


class TQPagesDesc(ctypes.Structure):
    _fields_ = [
        ("parts", TQPartDesc * 2),
        ("channels", _PTR),
        ("mean", _PTR),
        ("rope_mean", _PTR),
        ("inv_freq", _PTR),
        ("num_parts", _I32),
        ("pad", _I32),
    ]


class CodePagesDesc(ctypes.Structure):
    _fields_ = [(name, _PTR) for name in ("scale", "zero", "stage_of", "stage")] + [
        ("group", _I64),
        ("window", _I64),
        ("transform", _PTR),
        ("table", _PTR),
    ]


MIRRORS = {cls.__name__: cls for cls in (LinearDesc, LayerDesc, ModelDesc, TQPartDesc, TQPagesDesc, CodePagesDesc)}


def parse_layout(text: str) -> dict[str, dict[str, int]]:
    """``bd_struct_layout``'s lines → {struct: {"sizeof": bytes, field: offset, …}}."""
    layout: dict[str, dict[str, int]] = {}
    for line in text.split():
        key, value = line.split("=")
        struct, name = key.split(".")
        layout.setdefault(struct, {})[name] = int(value)
    return layout


def mismatches(layout: Mapping[str, Mapping[str, int]], mirrors: Mapping[str, type] = MIRRORS) -> list[str]:
    """What differs between the library's layout and the mirrors (empty: they agree)."""
    wrong = []
    for name, mirror in mirrors.items():
        native = layout.get(name)
        if native is None:
            wrong.append(f"{name}: the library does not report it")
            continue
        mine = {"sizeof": ctypes.sizeof(mirror), **{f[0]: getattr(mirror, f[0]).offset for f in mirror._fields_}}
        for field in sorted(set(native) | set(mine)):
            if native.get(field) != mine.get(field):
                wrong.append(f"{name}.{field}: library {native.get(field)}, mirror {mine.get(field)}")
    return wrong


def check(lib) -> None:
    """Raise :class:`ABIError` unless the library's structs match :data:`MIRRORS` byte for byte."""
    wrong = mismatches(parse_layout(lib.bd_struct_layout().decode()))
    if wrong:
        raise ABIError("the native library's structs differ from kernels/cpu/structs.py's mirrors: " + "; ".join(wrong))
