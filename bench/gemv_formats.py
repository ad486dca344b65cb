"""Batch-1 matrix-vector time per weight format on the native kernels (SmolLM2's MLP shapes), one process.

    PYTHONPATH=src python bench/gemv_formats.py [--threads 2] [--repeats 20] [--cpu-time]

Prints one JSON object: per format, the median µs of one product y = x Wᵀ (x: 1 × K) for W 1536 × 576 and
576 × 1536, the weight bytes read and the achieved GB/s; fp32 is PyTorch's F.linear on the float weight. Each
timed pass cycles through COPIES copies of the weight (fp32: 127 MB, far beyond the last-level cache), so every
product reads its weight from memory as in a decode step. A kernel-level check of "fewer bytes ⇒ faster"
without the rest of the decode step (bench/RESULTS.md). ``--cpu-time`` (with ``--threads 1``) times this thread's
CPU time instead of the wall clock: on a shared machine, the work a product costs without the waits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from bytediet.kernels import ops
from bytediet.quant import get_weight_format

SPECS = ("int8", "int8-af32", "fp8", "int8-w8a8", "sparse24", "sparse24-int8", "int4-g64")
SHAPES = ((1536, 576), (576, 1536))
COPIES = 36  # 36 × 3.5 MB of fp32 weights per pass


def median_us(fn, weights: list, repeats: int, clock=time.perf_counter) -> float:
    """Median over ``repeats`` passes of the time per product, a pass = one product with each weight copy."""
    for w in weights:
        fn(w)
    times = []
    for _ in range(repeats):
        t0 = clock()
        for w in weights:
            fn(w)
        times.append((clock() - t0) / len(weights))
    return 1e6 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--cpu-time", action="store_true", help="time this thread's CPU time (use with --threads 1)")
    a = p.parse_args()
    clock = time.thread_time if a.cpu_time else time.perf_counter
    torch.set_num_threads(a.threads)
    lib = ops.native_library()
    lib.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    out = {"isa": lib.isa, "threads": a.threads, "clock": "thread CPU time" if a.cpu_time else "wall", "formats": {}}
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.05
        x = torch.randn(1, k, generator=gen)
        copies = [w.clone() for _ in range(COPIES)]
        rows = {"fp32": (median_us(lambda c: F.linear(x, c), copies, a.repeats, clock), w.numel() * 4)}
        for spec in SPECS:
            fmt = get_weight_format(spec)
            t, blocks = fmt.native_layout(fmt.quantize(w))
            copies = [blocks.clone() for _ in range(COPIES)]
            us = median_us(lambda c: ops.gemm_blocks(t, c, x, None, fmt.activations), copies, a.repeats, clock)
            rows[spec] = (us, blocks.numel())
        for spec, (us, nbytes) in rows.items():
            out["formats"].setdefault(spec, {})[f"{n}x{k}"] = {
                "us": round(us, 1),
                "bytes": nbytes,
                "GB_s": round(nbytes / us / 1e3, 2),
            }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
