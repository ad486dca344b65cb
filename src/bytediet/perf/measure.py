"""Measure this machine's ceilings: memory read and copy bandwidth, and matmul FLOP/s per dtype.

Each probe runs for a fraction of a second (the whole set well under ~10 s on 2 cores) and keeps
the best of a few repeats — the ceiling, not the average. Results are cached as JSON in
``$BYTEDIET_CACHE`` (default ``~/.cache/bytediet``), one file per host and CPU model, so the
roofline of ``this-machine`` costs nothing after the first call; ``bytediet roofline --measure``
re-measures.

Probes (sizes chosen to spill out of the last-level cache where it matters):
- read bandwidth: ``x.sum()`` over a 1 GiB fp32 tensor → bytes read / time;
- copy bandwidth: ``y.copy_(x)`` → (bytes read + bytes written) / time;
- fp32 / bf16 / fp16 GEMM: ``torch.matmul`` of square matrices → 2·n³ / time;
- int8 GEMM: ``torch._int_mm`` (int8 × int8 → int32) when this PyTorch build has it on the CPU.
A dtype whose probe is unavailable or slower than fp32 is still recorded: it is what the machine does.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from ..errors import BytedietError
from ..kernels.cpu.build import cpu_model  # the one reader of /proc/cpuinfo
from .hardware import HardwareSpec

CACHE_VERSION = 1


def cache_dir() -> Path:
    return Path(os.environ.get("BYTEDIET_CACHE") or Path.home() / ".cache" / "bytediet")


def machine_key(threads: int) -> str:
    """File-name-safe key: hostname + CPU model + thread count."""
    raw = f"{socket.gethostname()}|{cpu_model()}|{os.cpu_count()}|{threads}"
    return f"{socket.gethostname()}-{hashlib.sha1(raw.encode()).hexdigest()[:10]}"


def cache_path(threads: int) -> Path:
    return cache_dir() / f"hardware-{machine_key(threads)}.json"


def _best_time(fn: Callable[[], object], repeats: int, budget_s: float) -> float:
    fn()  # warm-up (page faults, kernel selection)
    best, start = float("inf"), time.perf_counter()
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() - start > budget_s:
            break
    return best


def _gemm_flops(dtype: torch.dtype, n: int, budget_s: float) -> Optional[float]:
    if dtype == torch.int8:
        if not hasattr(torch, "_int_mm"):
            return None
        a = torch.randint(-100, 100, (n, n), dtype=torch.int8)
        b = torch.randint(-100, 100, (n, n), dtype=torch.int8)
        fn = lambda: torch._int_mm(a, b)
    else:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        fn = lambda: torch.matmul(a, b)
    try:
        t = _best_time(fn, repeats=5, budget_s=budget_s)
    except RuntimeError:  # the op has no kernel for this dtype on this build
        return None
    return 2.0 * n**3 / t


def _memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9


def _last_level_cache_bytes() -> Optional[float]:
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        mult = {"K": 1024, "M": 1024**2}.get(text[-1], 1)
        sizes.append(float(text.rstrip("KM")) * mult)
    return max(sizes) if sizes else None


def measure(threads: int = 2, read_mib: int = 1024) -> dict:
    """Run every probe once and return a JSON-able dict of the results (units: B/s, FLOP/s)."""
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = read_mib * 2**20 // 4
        x = torch.ones(n)
        y = torch.empty_like(x)
        read_bw = x.numel() * 4 / _best_time(lambda: x.sum(), repeats=5, budget_s=1.5)
        copy_bw = 2 * x.numel() * 4 / _best_time(lambda: y.copy_(x), repeats=5, budget_s=1.5)
        x = y = None  # free the probe's buffers before the GEMMs (the lambdas above are done with them)
        peaks = {"fp32": _gemm_flops(torch.float32, 1024, 1.5)}
        for name, dt, size in (("bf16", torch.bfloat16, 1024), ("fp16", torch.float16, 512), ("int8", torch.int8, 512)):
            value = _gemm_flops(dt, size, 1.0)
            if value is not None:
                peaks[name] = value
    finally:
        torch.set_num_threads(old_threads)
    return {
        "version": CACHE_VERSION,
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "threads": threads,
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "read_bandwidth": read_bw,
        "copy_bandwidth": copy_bw,
        "peak_flops": peaks,
        "memory_bytes": _memory_bytes(),
        "llc_bytes": _last_level_cache_bytes(),
    }


def spec_from_measurement(m: dict) -> HardwareSpec:
    """A :class:`HardwareSpec` whose bandwidth is the measured *read* bandwidth (what decode does)."""
    where = (
        f"measured by bytediet.perf.measure on {m['host']} ({m['cpu']}, {m['threads']} threads) at {m['measured_at']}"
    )
    return HardwareSpec(
        id="this-machine",
        name=f"this machine: {m['cpu']} x{m['threads']} threads",
        peak_flops=m["peak_flops"],
        memory_bytes=m["memory_bytes"],
        memory_bandwidth=m["read_bandwidth"],
        onchip_bytes=m.get("llc_bytes"),
        measured=True,
        sources={
            "peak_flops": where,
            "memory_bandwidth": where,
            "memory_bytes": "os.sysconf (physical pages)",
            "onchip_bytes": "/sys/devices/system/cpu/cpu0/cache (largest cache level)",
        },
        notes=f"copy bandwidth {m['copy_bandwidth'] / 1e9:.1f} GB/s (read + write counted); "
        f"torch {m['torch']}; no interconnect (single host).",
    )


def load_cached(threads: int = 2) -> Optional[dict]:
    path = cache_path(threads)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if data.get("version") == CACHE_VERSION else None


def measure_and_cache(threads: int = 2) -> dict:
    data = measure(threads)
    path = cache_path(threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
    return data


def this_machine(measure_if_missing: bool = True, threads: int = 2, remeasure: bool = False) -> HardwareSpec:
    """This machine's measured ceilings, from the cache or (if allowed) measured now (~5 s)."""
    data = None if remeasure else load_cached(threads)
    if data is None:
        if not (measure_if_missing or remeasure):
            raise BytedietError(
                f"this machine has not been measured yet ({cache_path(threads)} is missing); "
                "run `bytediet roofline --measure` first"
            )
        data = measure_and_cache(threads)
    return spec_from_measurement(data)
