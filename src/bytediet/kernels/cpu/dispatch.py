"""Pick and load the native kernel library for this CPU, once per process.

The variant is the best one this CPU's flags allow (``build.VARIANTS``, best last), or the one named by
``BYTEDIET_KERNELS`` (``avx2``, ``avx512vnni``; ``reference`` turns the native kernels off). When nothing
can be loaded — no compiler, a failed build, a CPU without AVX2 — :func:`native` returns None, one warning
line says why, and :mod:`bytediet.kernels.ops` runs the PyTorch reference instead.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from typing import Optional

from . import build, structs

_VOID_P, _LONG, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
# the queries and their batch, as both paged attentions take them: q, out, T, hq, hkv, d, scale, window; positions,
# token_rows, block_tables, the tables' width, block_size
_ATTENTION_BATCH = [_VOID_P, _VOID_P, _LONG, _LONG, _LONG, _LONG, _FLOAT, _LONG] + [_VOID_P] * 3 + [_LONG, _LONG]
SIGNATURES = {  # C ABI of csrc/*.cpp: name → (restype, argtypes)
    "bd_set_num_threads": (None, [_INT]),
    "bd_num_threads": (_INT, []),
    "bd_set_spin_us": (None, [_INT]),
    "bd_isa": (ctypes.c_char_p, []),
    "bd_type_ids": (ctypes.c_char_p, []),
    "bd_struct_layout": (ctypes.c_char_p, []),
    "bd_gemm_blocks": (_INT, [_INT, _VOID_P, _LONG, _LONG, _VOID_P, _LONG, _VOID_P, _VOID_P, _INT]),
    "bd_dequantize_blocks": (_INT, [_INT, _VOID_P, _LONG, _LONG, _VOID_P]),
    "bd_dequantize_blocks_bf16": (_INT, [_INT, _VOID_P, _LONG, _LONG, _VOID_P]),
    "bd_quantize_rows_q8": (None, [_VOID_P, _LONG, _LONG, _VOID_P, _VOID_P, _VOID_P]),
    "bd_repack_x4": (_INT, [_INT, _VOID_P, _LONG, _LONG, _VOID_P]),
    "bd_x4_row_bytes": (_LONG, [_INT, _LONG]),
    "bd_gelu_tanh_mul": (None, [_VOID_P, _VOID_P, _LONG, _VOID_P]),
    "bd_silu_mul": (None, [_VOID_P, _VOID_P, _LONG, _VOID_P]),
    "bd_rms_norm_rows": (None, [_VOID_P, _VOID_P, _LONG, _LONG, _FLOAT, _VOID_P]),
    "bd_sample_rows": (None, [_VOID_P, _LONG, _LONG, _VOID_P, _VOID_P, _VOID_P]),
    "bd_has_gemm_panel": (_INT, [_INT]),
    "bd_gemm_panel": (_INT, [_INT, _VOID_P, _LONG, _LONG, _VOID_P, _LONG, _VOID_P, _VOID_P]),
    "bd_gemm_x4": (_INT, [_INT, _VOID_P, _LONG, _LONG, _VOID_P, _LONG, _VOID_P, _VOID_P, _INT]),
    "bd_quantize_rows_per_token": (None, [_VOID_P, _LONG, _LONG, _VOID_P, _VOID_P, _VOID_P]),
    "bd_quantize_rows_q16": (None, [_VOID_P, _LONG, _LONG, _VOID_P, _VOID_P, _VOID_P, _VOID_P, _VOID_P]),
    "bd_decode_step": (_INT, [_VOID_P, _VOID_P, _LONG, _VOID_P, _VOID_P, _VOID_P, _VOID_P, _LONG, _LONG]),
    "bd_read_kv_rows": (_INT, [_INT, _VOID_P, _VOID_P, _LONG, _LONG, _VOID_P]),
    "bd_write_kv_rows": (_INT, [_INT, _VOID_P, _LONG, _LONG, _VOID_P, _VOID_P]),
    "bd_paged_attention": (_INT, [_INT, _INT, *_ATTENTION_BATCH, _VOID_P, _VOID_P, _VOID_P, _VOID_P, _VOID_P, _VOID_P]),
    "bd_turboquant_write": (_INT, [_VOID_P, _VOID_P, _LONG, _VOID_P, _VOID_P, _LONG, _LONG]),
    "bd_turboquant_attention": (_INT, [_INT, _INT, *[_VOID_P] * 6, *_ATTENTION_BATCH]),
}


class NativeLibrary:
    """A loaded variant: its functions with argument types set, its ISA name and its file."""

    def __init__(self, path: str, variant: str) -> None:
        self.path, self.variant = path, variant
        self.lib = ctypes.CDLL(path)
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self.isa = self.lib.bd_isa().decode()

    def __getattr__(self, name: str):
        return getattr(self.lib, name)

    def type_ids(self) -> dict[str, dict[str, int]]:
        """Every id the library names (csrc/types.h): {family: {NAME: value}}."""
        ids: dict[str, dict[str, int]] = {}
        for line in self.lib.bd_type_ids().decode().split():
            key, value = line.split("=")
            family, name = key.split(".")
            ids.setdefault(family, {})[name] = int(value)
        return ids

    def set_num_threads(self, n: int) -> None:
        self.lib.bd_set_num_threads(max(1, int(n)))


def requested_variant() -> str:
    """``BYTEDIET_KERNELS`` (lower-case), or ``auto``."""
    return os.environ.get("BYTEDIET_KERNELS", "auto").strip().lower() or "auto"


@functools.lru_cache(maxsize=None)
def load(variant_name: str) -> NativeLibrary:
    """Build (if needed) and load one variant; raises KernelBuildError or OSError."""
    v = build.variant(variant_name)
    missing = v.cpu_flags - build.cpu_flags()
    if missing:
        raise build.KernelBuildError(
            f"this CPU cannot run the {v.name} kernels (it lacks {', '.join(sorted(missing))})"
        )
    path = build.build(v)
    try:
        lib = NativeLibrary(str(path), v.name)
    except (OSError, AttributeError):  # a cached file that passed its checksum but will not load: rebuild once
        lib = NativeLibrary(str(build.build(v, force=True)), v.name)
    structs.check(lib)  # a mirror that drifted from its struct fails here, not as garbage read later
    lib.set_num_threads(_default_threads())
    return lib


def _default_threads() -> int:
    import torch

    return torch.get_num_threads()


def native(variant_name: Optional[str] = None) -> Optional[NativeLibrary]:
    """The library to use (``variant_name`` or the requested/best one), or None with one warning line."""
    return _native(variant_name or requested_variant())


@functools.lru_cache(maxsize=None)
def _native(name: str) -> Optional[NativeLibrary]:
    if name == "reference":
        return None
    if name == "auto":
        runnable = build.runnable_variants()
        if not runnable:
            warnings.warn("bytediet: this CPU lacks AVX2/FMA/F16C; running the PyTorch reference kernels", stacklevel=2)
            return None
        name = runnable[-1].name
    try:
        return load(name)
    except (build.KernelBuildError, OSError, KeyError) as e:
        first = str(e).splitlines()[0]
        warnings.warn(
            f"bytediet: native kernels unavailable ({first}); running the PyTorch reference kernels", stacklevel=2
        )
        return None


def describe() -> dict:
    """What runs here: the variant, its ISA and library file, or why the reference runs."""
    lib = native()
    if lib is None:
        return {"kernels": "reference", "isa": None, "requested": requested_variant()}
    return {
        "kernels": "native",
        "isa": lib.isa,
        "library": lib.path,
        "threads": lib.bd_num_threads(),
        "omp_spincount": os.environ.get("GOMP_SPINCOUNT"),
    }  # set by bytediet/__init__.py unless the user did
