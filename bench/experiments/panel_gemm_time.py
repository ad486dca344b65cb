"""Prefill products of Gemma-3's shapes: the int8 panel GEMM (csrc/gemm_panel.cpp, q16 activations) against the
weight decoded once + PyTorch's fp32 GEMM, GFLOP/s at M rows, best of 7 interleaved runs (bench/RESULTS.md,
Recording 9, "Kernel: prediction against measurement"). Run on a quiet machine:

    PYTHONPATH=src .venv/bin/python bench/experiments/panel_gemm_time.py [--rows 512] [--threads 2]
"""

import argparse
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

import bytediet  # noqa: F401 - sets GOMP_SPINCOUNT before torch loads libgomp
from bytediet.kernels import ops
from bytediet.kernels.ggml_codecs import ENCODERS

SHAPES = [(T.Q5_0, 2048, 640), (T.Q5_0, 1024, 640), (T.Q4_K, 640, 1024), (T.Q6_K, 640, 2048)]
K_QUANT_BYTES = {T.Q4_K: (144, [0, 2]), T.Q6_K: (210, [208])}  # block bytes, offsets of its f16 scales


def random_blocks(gtype, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    if gtype in ENCODERS:
        return ENCODERS[gtype](torch.randn(n * k // 32, 32, generator=gen)).reshape(n, -1)
    size, at = K_QUANT_BYTES[gtype]
    b = torch.randint(0, 256, (n * k // 256, size), generator=gen, dtype=torch.uint8)
    d = torch.from_numpy(np.array([0.01], dtype=np.float16).view(np.uint8).copy())
    for o in at:
        b[:, o : o + 2] = d
    return b.reshape(n, -1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ops.native_library().set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(1)
    data = {s: (random_blocks(s[0], s[1], s[2], gen), torch.randn(args.rows, s[2], generator=gen)) for s in SHAPES}
    runs = {
        "panel": lambda t, b, x: ops.gemm_panel(t, b, x),
        "fp32": lambda t, b, x: torch.nn.functional.linear(x, ops.dequantize_blocks(t, b)),
    }
    best = {(s, r): float("inf") for s in SHAPES for r in runs}
    for _ in range(7):
        for s in SHAPES:
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn(int(s[0]), *data[s])
                best[(s, name)] = min(best[(s, name)], time.perf_counter() - t0)
    for s in SHAPES:
        flops = 2 * args.rows * s[1] * s[2]
        print(
            f"{s[0].name} {s[1]}×{s[2]}: fp32 {flops / best[(s, 'fp32')] / 1e9:.0f} GFLOP/s, "
            f"panel {flops / best[(s, 'panel')] / 1e9:.0f} GFLOP/s"
        )


if __name__ == "__main__":
    main()
