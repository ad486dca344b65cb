"""Measure a CUDA GPU's ceilings as :mod:`bytediet.perf.measure` measures the CPU's: read and copy bandwidth of its
memory, and matmul FLOP/s per dtype (bf16, fp16, fp32, tf32, fp8 where ``torch._scaled_mm`` runs).

Timed with CUDA events, best of a few repeats after a warm-up; ~2 s in all. Cached beside the CPU's measurements,
one file per GPU model and host (``bytediet roofline --measure`` and ``bench --measure`` re-measure).
"""

from __future__ import annotations

import json
import socket
import time
from typing import Callable, Optional

import torch

from .hardware import HardwareSpec
from .measure import CACHE_VERSION, cache_dir


def _best_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    """The fastest of ``repeats`` timed calls (ms), after one warm-up, by CUDA events."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def _matmul_flops(dtype: torch.dtype, n: int, device) -> Optional[float]:
    """2·n³ / time of an n×n×n product in ``dtype`` (fp8: ``torch._scaled_mm``), or None where it does not run."""
    try:
        a = torch.randn(n, n, device=device)
        b = torch.randn(n, n, device=device)
        if dtype == torch.float8_e4m3fn:
            a8, b8 = a.to(dtype), b.t().contiguous().to(dtype).t()  # _scaled_mm: column-major right operand
            one = torch.ones((), device=device)
            fn = lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        elif dtype == torch.float32:  # float32, or tf32 tensor cores where torch allows them (the caller's setting)
            fn = lambda: torch.matmul(a, b)
        else:
            a, b = a.to(dtype), b.to(dtype)
            fn = lambda: torch.matmul(a, b)
        return 2.0 * n**3 / (_best_ms(fn) / 1e3)
    except (RuntimeError, TypeError):  # no kernel for this dtype on this chip / build
        return None


def measure_gpu(device: str = "cuda", read_mib: int = 2048) -> dict:
    """Every probe once on ``device``: a JSON-able dict (B/s, FLOP/s) shaped like :func:`measure.measure`'s."""
    device = torch.device(device)
    props = torch.cuda.get_device_properties(device)
    x = torch.ones(read_mib * 2**20 // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    nbytes = x.numel() * 2
    read_bw = nbytes / (_best_ms(lambda: x.sum(dtype=torch.float32)) / 1e3)
    copy_bw = 2 * nbytes / (_best_ms(lambda: y.copy_(x)) / 1e3)
    x = y = None  # freed before the matmul probes
    peaks = {
        name: _matmul_flops(dt, 8192, device)
        for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp8", torch.float8_e4m3fn))
    }
    allow = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, tf32 in (("fp32", False), ("tf32", True)):  # float32 products as computed, and on tf32 cores
            torch.backends.cuda.matmul.allow_tf32 = tf32
            peaks[name] = _matmul_flops(torch.float32, 8192, device)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow
    peaks = {k: v for k, v in peaks.items() if v is not None}
    return {
        "version": CACHE_VERSION,
        "host": socket.gethostname(),
        "cpu": props.name,
        "gpu": props.name,
        "threads": 0,
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "read_bandwidth": read_bw,
        "copy_bandwidth": copy_bw,
        "peak_flops": peaks,
        "memory_bytes": float(props.total_memory),
        "llc_bytes": float(getattr(props, "L2_cache_size", 0)) or None,
        "multiprocessors": props.multi_processor_count,
    }


def spec_from_gpu_measurement(m: dict) -> HardwareSpec:
    """A :class:`HardwareSpec` of a measured GPU (bandwidth: the measured read bandwidth, what decode does)."""
    where = f"measured by bytediet.perf.measure_gpu on {m['host']} ({m['gpu']}) at {m['measured_at']}"
    return HardwareSpec(
        id="this-gpu",
        name=f"this GPU: {m['gpu']}",
        peak_flops=m["peak_flops"],
        memory_bytes=m["memory_bytes"],
        memory_bandwidth=m["read_bandwidth"],
        onchip_bytes=m.get("llc_bytes"),
        measured=True,
        compute_dtype_default="bf16",
        sources={"peak_flops": where, "memory_bandwidth": where, "memory_bytes": "torch.cuda device properties"},
        notes=f"copy bandwidth {m['copy_bandwidth'] / 1e9:.0f} GB/s (read + write counted); torch {m['torch']}.",
    )


def this_gpu(device: str = "cuda", remeasure: bool = False) -> HardwareSpec:
    """This GPU's measured ceilings, from the cache or measured now (~2 s)."""
    name = torch.cuda.get_device_properties(torch.device(device)).name
    path = cache_dir() / f"hardware-{socket.gethostname()}-{''.join(c if c.isalnum() else '_' for c in name)}.json"
    data = None
    if not remeasure:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = None
    if data is None or data.get("version") != CACHE_VERSION:
        data = measure_gpu(device)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2))
    return spec_from_gpu_measurement(data)
