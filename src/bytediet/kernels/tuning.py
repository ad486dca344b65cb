"""Autotuning of the native kernels on this machine: ``bytediet tune`` measures, the engine reads.

What is tuned:

* per linear shape (block type, n, k) and batch (1 = decode, more = a batched step): which kernel multiplies
  it — the row-interleaved x4 layout (``gemm_x4``) or the row-tile kernel over the blocks as stored
  (``gemm_blocks``); only for the block types that have both;
* per linear shape at a prefill chunk (:data:`PREFILL_ROWS` rows): the int8 panel GEMM on q16 activations
  (``gemm_panel``) or the weight decoded once and PyTorch's fp32 GEMM (``"panel"`` / ``"fp32"``; where the
  library has the panel kernel — models/layers.py reads the winner for ``BYTEDIET_PREFILL_GEMM=int8``);
* for the library: how long the pool's workers spin after a parallel region before they sleep
  (``bd_set_spin_us``): short spins waste a core between regions, long ones pay a wake-up when they end.

Winners are stored as JSON under ``~/.cache/bytediet/tune/`` (or ``$BYTEDIET_TUNE_CACHE``), one file per
machine key: CPU model and flags, the loaded library file (its name carries the source hash, compiler and
flags), bytediet's version and the thread count — a new CPU, build or thread count starts from the defaults
(x4 wherever it exists, 200 µs of spin) until ``bytediet tune`` runs again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .cpu import build

TUNE_FORMAT = 1
DEFAULT_SPIN_US = 200
SPIN_CANDIDATES = (0, 50, 200, 1000)
PREFILL_ROWS = 256  # the batch a prefill chunk's products are tuned at


def cache_dir() -> Path:
    root = os.environ.get("BYTEDIET_TUNE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "bytediet", "tune"
    )
    return Path(root)


def machine_key(library_path: str, threads: int) -> dict:
    """What a tuning result is valid for."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        __version__ = version("bytediet")
    except PackageNotFoundError:  # run from a source tree
        __version__ = "source"
    return {
        "cpu": build.cpu_model(),
        "flags": hashlib.sha256(" ".join(sorted(build.cpu_flags())).encode()).hexdigest()[:16],
        "library": Path(library_path).name,
        "bytediet": __version__,
        "threads": int(threads),
    }


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"tune-{digest}.json"


def shape_key(ggml_type: int, n: int, k: int, batch: int) -> str:
    return f"{int(ggml_type)}:{int(n)}:{int(k)}:{int(batch)}"


@dataclass
class TuningTable:
    """The winners for one machine key; ``kernels``: shape_key → "x4" | "rows"."""

    key: dict
    kernels: dict[str, str] = field(default_factory=dict)
    spin_us: int = DEFAULT_SPIN_US
    measurements: list[dict] = field(default_factory=list)  # every candidate's time, for the report
    format: int = TUNE_FORMAT

    def kernel_for(self, ggml_type: int, n: int, k: int, batch: int = 1) -> Optional[str]:
        return self.kernels.get(shape_key(ggml_type, n, k, batch))

    def save(self) -> Path:
        path = cache_path(self.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, path)  # atomic: a reader never sees half a file
        return path

    @classmethod
    def load(cls, key: dict) -> Optional["TuningTable"]:
        """The stored table for ``key``, or None (none, unreadable, or for another key or format)."""
        try:
            data = json.loads(cache_path(key).read_text())
            table = cls(**data)
        except (OSError, ValueError, TypeError):
            return None
        return table if table.key == key and table.format == TUNE_FORMAT else None


@functools.lru_cache(maxsize=None)
def _loaded(library_path: str, threads: int) -> Optional[TuningTable]:
    return TuningTable.load(machine_key(library_path, threads))


def current(lib) -> Optional[TuningTable]:
    """The table for the loaded library ``lib`` at its thread count (cached per process), or None."""
    if lib is None:
        return None
    return _loaded(lib.path, lib.bd_num_threads())


def forget() -> None:
    """Drop the per-process cache (after ``bytediet tune`` writes a new table)."""
    _loaded.cache_clear()


def apply(lib) -> Optional[TuningTable]:
    """Give the library its tuned spin time; returns the table in use (None: the defaults)."""
    table = current(lib)
    if lib is not None:
        lib.bd_set_spin_us(table.spin_us if table else DEFAULT_SPIN_US)
    return table


# ----------------------------------------------------------------------------------- measuring
def _best_time(fn: Callable[[], object], repeats: int, timer: Callable[[], float]) -> float:
    fn()  # warm-up: first-touch of buffers, code paths
    times = []
    for _ in range(repeats):
        t0 = timer()
        fn()
        times.append(timer() - t0)
    return min(times)


def tune(
    lib,
    shapes: Sequence[tuple[int, int, int]],
    *,
    batches: Sequence[int] = (1, 16),
    activations: str = "q16",
    repeats: int = 20,
    spin_candidates: Sequence[int] = SPIN_CANDIDATES,
    prefill_rows: int = PREFILL_ROWS,
    timer: Callable[[], float] = time.perf_counter,
    progress: Callable[[str], None] = lambda msg: None,
) -> TuningTable:
    """Time the candidates for each (block type, n, k) at each batch, then the spin times over a decode-like
    sequence of all the shapes at batch 1; returns the table (not yet saved)."""
    from . import ops
    from .ggml_codecs import ENCODERS

    table = TuningTable(machine_key(lib.path, lib.bd_num_threads()))
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for gtype, n, k in dict.fromkeys(shapes):
        if not ops.can_interleave(gtype, n, k) or gtype not in ENCODERS:
            continue  # one kernel only: nothing to choose
        blocks = ENCODERS[gtype](torch.randn(n * k // 32, 32, generator=gen) * 0.1).reshape(n, -1)
        weights[(gtype, n, k)] = (blocks, ops.repack_x4(gtype, blocks))
    for (gtype, n, k), (blocks, x4) in weights.items():
        for batch in batches:
            x = torch.randn(batch, k, generator=gen)
            t_x4 = _best_time(lambda: ops.gemm_x4(gtype, x4, x, None, activations), repeats, timer)
            t_rows = _best_time(lambda: ops.gemm_blocks(gtype, blocks, x, None, activations), repeats, timer)
            winner = "x4" if t_x4 <= t_rows else "rows"
            table.kernels[shape_key(gtype, n, k, batch)] = winner
            table.measurements.append(
                {"type": gtype, "n": n, "k": k, "batch": batch, "x4_s": t_x4, "rows_s": t_rows, "winner": winner}
            )
            progress(
                f"type {gtype} {n}×{k} batch {batch}: x4 {t_x4 * 1e6:.0f} µs, rows {t_rows * 1e6:.0f} µs → {winner}"
            )
        if prefill_rows and activations == "q16" and ops.has_gemm_panel(gtype):
            x = torch.randn(prefill_rows, k, generator=gen)
            t_panel = _best_time(lambda: ops.gemm_panel(gtype, blocks, x), max(3, repeats // 4), timer)
            t_fp32 = _best_time(
                lambda: torch.nn.functional.linear(x, ops.dequantize_blocks(gtype, blocks)), max(3, repeats // 4), timer
            )
            winner = "panel" if t_panel <= t_fp32 else "fp32"
            table.kernels[shape_key(gtype, n, k, prefill_rows)] = winner
            table.measurements.append(
                {
                    "type": gtype,
                    "n": n,
                    "k": k,
                    "batch": prefill_rows,
                    "panel_s": t_panel,
                    "fp32_s": t_fp32,
                    "winner": winner,
                }
            )
            progress(
                f"type {gtype} {n}×{k} prefill ({prefill_rows} rows): panel {t_panel * 1e3:.2f} ms, "
                f"fp32 {t_fp32 * 1e3:.2f} ms → {winner}"
            )
    if weights and spin_candidates:
        xs = {k: torch.randn(1, k, generator=gen) for (_, _, k) in weights}

        def decode_like():  # the sequence of small products of one decode step, back to back
            for (gtype, n, k), (blocks, x4) in weights.items():
                if table.kernel_for(gtype, n, k, 1) == "rows":
                    ops.gemm_blocks(gtype, blocks, xs[k], None, activations)
                else:
                    ops.gemm_x4(gtype, x4, xs[k], None, activations)

        spins = {}
        for spin in spin_candidates:
            lib.bd_set_spin_us(int(spin))
            spins[int(spin)] = statistics.median(_best_time(decode_like, max(3, repeats // 4), timer) for _ in range(3))
            progress(f"pool spin {spin} µs: {spins[int(spin)] * 1e3:.2f} ms per decode-like pass")
        table.spin_us = min(spins, key=spins.get)
        table.measurements.append({"spin_us_s": {str(s): t for s, t in spins.items()}, "winner": table.spin_us})
        lib.bd_set_spin_us(table.spin_us)
    return table
