"""Compile Triton weight kernels for a CUDA target without a GPU (Triton's own compiler and ptxas), so a kernel that
only the interpreter accepts fails on the CPU too.

    PYTHONPATH=src python tests/kernels/triton/compile_for_gpu.py [--arch 90] [LAYOUT ...]   # exit 1 on a failure
Run in its own process: TRITON_INTERPRET must be unset or 0 when the kernels are defined.
"""

from __future__ import annotations

import argparse
import inspect
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bytediet.kernels.triton import gemm_blocks as g
from bytediet.kernels.triton import kquants, runs
from bytediet.kernels.triton import sparse24_blocks as sb

PTRS = {"x_ptr": "*bf16", "w_ptr": "*u8", "b_ptr": "*bf16", "y_ptr": "*bf16"}


def compile_kernel(kernel, consts: dict, arch: int, y: str = "*bf16") -> None:
    """Compile ``kernel`` with these constexprs (pointers as PTRS, y as ``y``, other arguments i32)."""
    params = list(inspect.signature(kernel.fn).parameters)
    types = dict(PTRS, y_ptr=y)
    sig = {p: "constexpr" if p in consts else types.get(p, "i32") for p in params}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(params.index(k),): v for k, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


def kernels_of(t: int):
    """(name, kernel, constexprs, y type) of every kernel gemm_blocks/dequantize_blocks may launch for layout t."""
    group, sym = g._int4_params(t)
    flags = {"TYPE": t, "HAS_BIAS": True, "ROUND_BF16": False}
    dot = dict(flags, DOT_F32=False, BM=64, BN=128)
    if t in runs.TYPES:
        head, bw, bb, co = runs.run_geometry(t, group, sym)
        geo = {"SYM": sym, "HEAD": head, "BW": bw, "BB": bb, "CO": co}
        yield "runs.gemv", runs.gemv_kernel, dict(flags, **geo, BN=16, NB=8), "*fp32"
        yield "runs.gemm", runs.gemm_kernel, dict(dot, **geo, NB=2), "*bf16"
    if t in kquants.TYPES:
        yield "kquants.gemv", kquants.gemv_kernel, dict(flags, BN=16, NB=2), "*fp32"
        yield "kquants.gemm", kquants.gemm_kernel, dict(dot, NB=1), "*bf16"
    if t in sb.TYPES:
        yield "sparse24.gemv", sb.gemv_kernel, dict(flags, BN=16, NB=8), "*fp32"
        yield "elements.gemm", g._gemm_kernel, dict(dot, GROUP=group, SYM=sym, BK=64), "*bf16"
    yield (
        "dequantize",
        g._dequant_kernel,
        {"TYPE": t, "GROUP": group, "SYM": sym, "ROUND_BF16": False, "BN": 32, "BK": 256},
        "*bf16",
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 89, 90")
    p.add_argument("layouts", nargs="*", type=int, help="layout ids (default: all)")
    a = p.parse_args()
    failures = 0
    for t in a.layouts or sorted(g.TYPES):
        for name, kernel, consts, y in kernels_of(t):
            try:
                compile_kernel(kernel, consts, a.arch, y)
            except Exception as e:
                failures += 1
                while e.__cause__ is not None:
                    e = e.__cause__
                print(f"layout {t} {name}: {type(e).__name__}: {str(e).strip()[-300:]}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
