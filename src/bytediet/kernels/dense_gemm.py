"""The precision of the compute-bound float GEMM: fp32 (the default), or bf16 where this CPU multiplies bf16 fast.

A prefill chunk (≥ ``ops.DENSE_GEMM_MIN_ROWS`` rows) of a layer with native blocks decodes the weight once
(``ops.dequantize_blocks``) and multiplies it with PyTorch's GEMM (``models/layers.py``). Which precision is
fastest depends on the machine, and by a factor:

* CPUs with AVX-512-BF16 (``vdpbf16ps``, Zen 4/5, Cooper Lake) or AMX-BF16 (Sapphire Rapids and later) run
  oneDNN's bf16 GEMM at 2× (measured on a Zen 5 VM: 200 against 90 GFLOP/s per core; its fp32 FMA peak is
  116 GFLOP/s, 512-bit or not) to 10× (AMX tiles) the fp32 rate;
* without them oneDNN emulates bf16 and it is *slower* than fp32 (seen up to 100× on AVX2-only machines).

PyTorch's CPU bf16 GEMM also rounds its *output* to bf16, and that costs more than issue 12's rule for a default
allows (measured, ``bench/RESULTS.md`` "bf16 prefill GEMM": top-1 agreement 97.4 % on SmolLM2 and 97.3 % on
Gemma-3 against the fp32 reference, +0.03 % / +0.10 % perplexity; the rule asks ≥ 99 % and ≤ +0.3 %). So fp32
stays the default, and ``BYTEDIET_PREFILL_GEMM`` chooses:

* ``fp32`` (default): exact;
* ``bf16``: always bf16 (1.6× Gemma-3's prefill on that Zen 5 machine);
* ``auto``: bf16 where this CPU has a bf16 instruction *and* a timed (256 × 1024) @ (1024 × 1024) product (a few
  milliseconds, best of five, at the current thread count) runs at least :data:`MIN_SPEEDUP` × faster than fp32;
  fp32 otherwise — never assumed from the flags alone.

It applies only to the default ``q16`` activation mode; ``f32`` (``-af32`` specs) stays exact fp32 everywhere.
"""
from __future__ import annotations

import functools
import os
import time

import torch

MIN_SPEEDUP = 1.3
ENV = "BYTEDIET_PREFILL_GEMM"
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
_CHOICES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT = "fp32"


def dtype() -> torch.dtype:
    """torch.float32 or torch.bfloat16: the dtype of the compute-bound GEMM for the default (q16) activation mode."""
    return _choice(torch.get_num_threads())["dtype"]


def describe() -> dict:
    """What was chosen and why, for ``bench`` and ``generate --json``: ``{"dtype", "reason", "speedup"}``."""
    c = _choice(torch.get_num_threads())
    return {"dtype": "bf16" if c["dtype"] == torch.bfloat16 else "fp32", "reason": c["reason"],
            "speedup": c["speedup"]}


@functools.lru_cache(maxsize=None)
def _choice(threads: int) -> dict:
    asked = os.environ.get(ENV, "").strip().lower() or DEFAULT
    if asked not in (*_CHOICES, "auto"):
        raise ValueError(f"{ENV} must be one of {', '.join(_CHOICES)}, auto; got {asked!r}")
    if asked != "auto":
        reason = f"{ENV}={asked}" if asked != DEFAULT or os.environ.get(ENV) else \
            "the default (exact; bf16 costs top-1 agreement, see kernels/dense_gemm.py)"
        return {"dtype": _CHOICES[asked], "reason": reason, "speedup": None}
    from .cpu.build import cpu_flags

    if not BF16_FLAGS & cpu_flags():
        return {"dtype": torch.float32, "reason": "this CPU has no bf16 instruction (avx512_bf16, amx_bf16)",
                "speedup": None}
    speedup = measured_bf16_speedup()
    if speedup >= MIN_SPEEDUP:
        return {"dtype": torch.bfloat16, "reason": f"bf16 GEMM measured {speedup:.2f}x fp32", "speedup": speedup}
    return {"dtype": torch.float32, "reason": f"bf16 GEMM measured only {speedup:.2f}x fp32 (< {MIN_SPEEDUP})",
            "speedup": speedup}


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
