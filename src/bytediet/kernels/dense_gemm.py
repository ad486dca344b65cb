"""The compute-bound GEMM of a prefill chunk: int8 dot products on q16 activations (the default where this
CPU has AVX-512 VNNI), fp32, or bf16 where this CPU multiplies bf16 fast.

A prefill chunk (≥ ``ops.DENSE_GEMM_MIN_ROWS`` rows) of a layer with native blocks in the default ``q16``
activation mode runs one of:

* ``int8`` (the default): ``ops.gemm_panel`` — the weight's integer codes unpacked a panel of 32 rows at a time
  and dotted with the two int8 planes of the q16 activations by ``vpdpbusd`` (``csrc/gemm_panel.cpp``). The same
  numbers as the decode kernels (q16 everywhere: bench/RESULTS.md "Activation precision"), at 2–4× the rate of
  PyTorch's fp32 GEMM on the Zen 5 VMs (MKL runs its AVX2 code there: ~95 GFLOP/s per core against a 247 GFLOP/s
  FMA peak; ``vpdpbusd`` does 494 G byte products per second per core). Where the library has no such kernel
  (the ``avx2`` variant, a float-valued layout) this falls back to ``fp32``;
* ``fp32``: decode the weight once (``ops.dequantize_blocks``) and PyTorch's fp32 GEMM (MKL/oneDNN): exact;
* ``bf16``: the same in bf16 — 2× (Zen 5, ``vdpbf16ps``) to 10× (AMX) fp32 where the CPU has bf16 instructions,
  *slower* than fp32 (up to 100×) where oneDNN emulates them. PyTorch's CPU bf16 GEMM rounds its output to bf16,
  which costs more than issue 12's rule for a default allows (top-1 agreement 97.4 % on SmolLM2 and 97.3 % on
  Gemma-3, bench/RESULTS.md "bf16 prefill GEMM"), so it is opt-in.

``BYTEDIET_PREFILL_GEMM`` chooses: ``int8`` (default), ``fp32``, ``bf16``, or ``auto`` — bf16 where this CPU has
a bf16 instruction *and* a timed (256 × 1024) @ (1024 × 1024) product (best of five, at the current thread
count) runs at least :data:`MIN_SPEEDUP` × faster than fp32, the default otherwise — never assumed from the
flags alone. Only the ``q16`` activation mode is affected; ``f32`` (``-af32`` specs) stays exact fp32 everywhere.
"""

from __future__ import annotations

import functools
import os
import time

import torch

MIN_SPEEDUP = 1.3
ENV = "BYTEDIET_PREFILL_GEMM"
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
KINDS = ("int8", "fp32", "bf16")
DEFAULT = "int8"


def kind() -> str:
    """``"int8"``, ``"fp32"`` or ``"bf16"``: the compute-bound GEMM for the default (q16) activation mode. ``int8``
    still falls back to fp32 for a weight the library has no panel kernel for (``ops.has_gemm_panel``)."""
    return _choice(torch.get_num_threads())["kind"]


def dtype() -> torch.dtype:
    """The float dtype of the dequantize-then-GEMM path: bfloat16 when :func:`kind` is bf16, else float32."""
    return torch.bfloat16 if kind() == "bf16" else torch.float32


def describe() -> dict:
    """What was chosen and why, for ``bench`` and ``generate --json``: ``{"dtype", "reason", "speedup"}`` — dtype
    ``int8-q16`` when the int8 panel kernel runs on this machine, else ``fp32``/``bf16``."""
    c = _choice(torch.get_num_threads())
    name = c["kind"]
    if name == "int8":
        from . import ops

        lib = ops.native_library()
        if lib is None or not lib.bd_has_gemm_panel(2):
            return {
                "dtype": "fp32",
                "reason": f"{c['reason']}; int8 chosen, but the native library here has no AVX-512 VNNI panel "
                f"kernel ({lib.variant if lib else 'no native library'}): fp32",
                "speedup": c["speedup"],
            }
        name = "int8-q16"
    return {"dtype": name, "reason": c["reason"], "speedup": c["speedup"]}


@functools.lru_cache(maxsize=None)
def _choice(threads: int) -> dict:
    asked = os.environ.get(ENV, "").strip().lower() or DEFAULT
    if asked not in (*KINDS, "auto"):
        raise ValueError(f"{ENV} must be one of {', '.join(KINDS)}, auto; got {asked!r}")
    if asked != "auto":
        reason = (
            f"{ENV}={asked}"
            if os.environ.get(ENV)
            else "the default (q16 activations on int8 dot products, as the decode kernels; kernels/dense_gemm.py)"
        )
        return {"kind": asked, "reason": reason, "speedup": None}
    from .cpu.build import cpu_flags

    if not BF16_FLAGS & cpu_flags():
        return {"kind": DEFAULT, "reason": "this CPU has no bf16 instruction (avx512_bf16, amx_bf16)", "speedup": None}
    speedup = measured_bf16_speedup()
    if speedup >= MIN_SPEEDUP:
        return {"kind": "bf16", "reason": f"bf16 GEMM measured {speedup:.2f}x fp32", "speedup": speedup}
    return {
        "kind": DEFAULT,
        "reason": f"bf16 GEMM measured only {speedup:.2f}x fp32 (< {MIN_SPEEDUP})",
        "speedup": speedup,
    }


def measured_bf16_speedup(m: int = 256, k: int = 1024, n: int = 1024, repeats: int = 5) -> float:
    """fp32 time / bf16 time of one (m × k) @ (k × n) ``F.linear``, best of ``repeats`` each (after a warm-up)."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)

    def best(a: torch.Tensor, b: torch.Tensor) -> float:
        torch.nn.functional.linear(a, b)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.nn.functional.linear(a, b)
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(x, w) / best(x.bfloat16(), w.bfloat16())
