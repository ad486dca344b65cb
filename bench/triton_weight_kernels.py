"""The Triton weight kernels on a GPU: each layout checked against its twin, then timed on Llama-3-8B's shapes.

    PYTHONPATH=src python bench/triton_weight_kernels.py [--out triton_weights.json] [--formats int4-g128 q4_k ...]
    PYTHONPATH=src python bench/triton_weight_kernels.py --dry-run      # CPU, Triton interpreter, tiny shapes

Prints one JSON object (and a table on stderr). Per format:
* ``check``: y = gemm_blocks(x bf16) against reference.gemm_blocks (float64 on the CPU) for M = 1 and 64 rows on a
  256-row slice of each K, with the bound 2⁻⁷·|y| + (2⁻⁸ + K·2⁻²⁴)·Σ|x||w| (bf16 output rounding; W rounded to
  bf16 for the tensor cores; float32 accumulation) — ``worst`` is the largest error / bound (pass: ≤ 1);
* ``time``: median µs of one product per (shape, M), the weight bytes read, GB/s, and the same product by
  PyTorch's dense bf16 F.linear beside it (``speedup`` = bf16 µs / this µs). Each timed pass cycles through enough
  copies of the weight (random bytes: the time does not depend on the values) to read ≥ 256 MB, beyond L2.
fp8 additionally times W8A8 through torch._scaled_mm (``fp8-w8a8``) and sparse24 PyTorch's semi-structured
2:4 GEMM (``sparse24-cusparselt``) where the chip has them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS_M = (1, 16, 64, 512)
FORMATS = (
    "int8",
    "int4-g128",
    "int4-g128-sym",
    "int4-g32",
    "mxfp4",
    "nvfp4",
    "fp8",
    "sparse24",
    "sparse24-int8",
    "q4_0",
    "q8_0",
    "q4_k",
    "q5_k",
    "q6_k",
)
GGUF = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14}
READ_BYTES = 256 << 20


def packed(name: str, n: int, k: int, gen: torch.Generator) -> tuple[int, torch.Tensor]:
    """(layout id, rows) of a random (n, k) weight, quantized by the repo's own codecs/formats."""
    from gguf import GGMLQuantizationType as T

    from bytediet.kernels.ggml_codecs import ENCODERS
    from bytediet.quant import get_weight_format

    if name in GGUF:
        t = T(GGUF[name])
        if t in ENCODERS:
            return int(t), ENCODERS[t](torch.randn(n * k // 32, 32, generator=gen)).reshape(n, -1)
        size, scale_at = {12: (144, [0, 2]), 13: (176, [0, 2]), 14: (210, [208])}[int(t)]
        b = torch.randint(0, 256, (n * k // 256, size), generator=gen, dtype=torch.uint8)
        for at in scale_at:  # sane f16 scales (0.01) in random super-blocks
            b[:, at : at + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
        return int(t), b.reshape(n, -1)
    fmt = get_weight_format(name)
    return fmt.native_layout(fmt.quantize(torch.randn(n, k, generator=gen) * 0.05))


def check(name: str, device: str, ks, ms, gen) -> float:
    """Largest error / bound over the checked products (≤ 1 passes)."""
    from bytediet.kernels import reference
    from bytediet.kernels.triton.gemm_blocks import gemm_blocks

    worst = 0.0
    for k in ks:
        t, rows = packed(name, 256 if device == "cuda" else 32, k, gen)
        w = reference.dequantize_blocks(t, rows).double()
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            y = gemm_blocks(t, rows.to(device), x.to(device)).cpu().double()
            ref = reference.gemm_blocks(t, rows, x, None, "f32").double()
            bound = 2.0**-7 * ref.abs() + (2.0**-8 + k * 2.0**-24) * (x.double().abs() @ w.abs().T) + 1e-30
            worst = max(worst, float(((y - ref).abs() / bound).max()))
    return worst


def median_us(fn, copies: list, repeats: int, device: str) -> float:
    """Median over ``repeats`` passes of the time of one call, a pass calling ``fn`` on each copy once."""
    for c in copies[:2]:
        fn(c)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for c in copies:
                fn(c)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / len(copies))
        else:
            t0 = time.perf_counter()
            for c in copies:
                fn(c)
            times.append((time.perf_counter() - t0) * 1e6 / len(copies))
    return statistics.median(times)


def time_format(name: str, device: str, shapes: dict, ms, repeats: int, gen) -> dict:
    """Per shape and M: µs, bytes, GB/s and the dense bf16 product's µs."""
    from bytediet.kernels.triton.gemm_blocks import gemm_blocks

    out = {}
    for shape_name, (n, k) in shapes.items():
        t, one = packed(name, 1, k, gen)
        nbytes = n * one.shape[1]
        many = device == "cuda"  # the interpreter: one copy (it proves the script, it times nothing)
        copies = [
            torch.randint(0, 256, (n, one.shape[1]), dtype=torch.uint8, device=device)
            for _ in range(max(1, min(16, READ_BYTES // nbytes)) if many else 1)
        ]
        dense = [
            torch.randn(n, k, device=device, dtype=torch.bfloat16)
            for _ in range(max(1, min(8, READ_BYTES // (2 * n * k))) if many else 1)
        ]
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            us = median_us(partial(gemm_blocks, t, x=x), copies, repeats, device)
            base = median_us(partial(F.linear, x), dense, repeats, device)
            out[f"{shape_name} {n}x{k} M={m}"] = {
                "us": round(us, 2),
                "bytes": nbytes,
                "GB/s": round(nbytes / us / 1e3, 1),
                "bf16_us": round(base, 2),
                "speedup": round(base / us, 2),
            }
    return out


def time_tensor_core_paths(name: str, shapes: dict, ms, repeats: int) -> dict:
    """fp8 through torch._scaled_mm, sparse24 through semi-structured tensors (where the chip has them)."""
    device = torch.device("cuda")
    out = {}
    for shape_name, (n, k) in shapes.items():
        if name == "fp8":
            from bytediet.kernels.triton import fp8

            if fp8.fp8_unsupported_reason(device):
                return {"skipped": fp8.fp8_unsupported_reason(device)}
            q = torch.randn(n, k, device=device).clamp(-400, 400).to(torch.float8_e4m3fn)
            s = torch.rand(n, device=device)
            fn = partial(fp8.fp8_linear, qweight=q, scale=s)
        else:
            from bytediet.kernels.triton import sparse24

            if sparse24.semi_structured_unsupported_reason(device):
                return {"skipped": sparse24.semi_structured_unsupported_reason(device)}
            mask = torch.tensor([1, 1, 0, 0], device=device, dtype=torch.bfloat16).repeat(n, k // 4)
            w = sparse24.to_semi_structured(torch.randn(n, k, device=device, dtype=torch.bfloat16) * mask)
            fn = partial(sparse24.sparse24_linear, weight=w)
        for m in ms:
            xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(8)]
            out[f"{shape_name} {n}x{k} M={m}"] = {"us": round(median_us(fn, xs, repeats, "cuda"), 2)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes: proves the script")
    p.add_argument("--formats", nargs="*", default=list(FORMATS))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", help="also write the JSON object here")
    a = p.parse_args()
    if a.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    elif not torch.cuda.is_available():
        sys.exit("no CUDA GPU: run with --dry-run to check the script on the CPU")
    device = "cpu" if a.dry_run else "cuda"
    shapes = {"tiny": (32, 256)} if a.dry_run else SHAPES_8B
    ms = (1, 17) if a.dry_run else ROWS_M
    gen = torch.Generator().manual_seed(0)
    result = {"device": "cpu (interpreter)" if a.dry_run else torch.cuda.get_device_name(), "formats": {}}
    for name in a.formats:
        t0 = time.perf_counter()
        worst = check(name, device, (256,) if a.dry_run else (4096, 14336), (1, 17) if a.dry_run else (1, 64), gen)
        entry = {
            "check": {"worst": round(worst, 4), "pass": worst <= 1.0},
            "time": time_format(name, device, shapes, ms, 1 if a.dry_run else a.repeats, gen),
        }
        if name in ("fp8", "sparse24") and not a.dry_run:
            entry[name + ("-w8a8" if name == "fp8" else "-cusparselt")] = time_tensor_core_paths(
                name, shapes, ms, a.repeats
            )
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        result["formats"][name] = entry
        rows = " ".join(
            f"{key.split()[0]}/M{key.split('=')[1]}:{v['us']}us({v['speedup']}x)" for key, v in entry["time"].items()
        )
        print(f"{name:14s} check {'ok' if worst <= 1 else 'FAIL'} {worst:.3f}  {rows}", file=sys.stderr, flush=True)
    text = json.dumps(result)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
