"""Off-chip traffic of one GEMM under three dataflows, and the best tile that fits on chip.

C (M×N) = A (M×K, activations) · B (K×N, weights), elements of ``elem_bytes`` (partial sums of
``acc_bytes``). The chip holds ``sram_bytes``; whatever does not stay there crosses the off-chip
link. Which operand *stays* defines the dataflow (Chen, Emer & Sze, "Eyeriss", ISCA 2016; Kung,
"Why systolic architectures?", 1982):

- **weight-stationary** (TPU-style systolic array): a Tk×Tn block of B stays; all M rows of A
  stream past it. B is read once; A is re-read once per column block (⌈N/Tn⌉ times); unless the
  block spans all of K (Tk = K), partial sums of C spill: written ⌈K/Tk⌉ times, read back
  ⌈K/Tk⌉−1 times. Footprint: Tk·Tn·e + one streamed row (Tk·e) and its partial sums (Tn·acc).
- **output-stationary** (the classic GPU tiled GEMM): a Tm×Tn block of C accumulates on chip
  while A and B stream through it one k-slice at a time. C is written once; A is read ⌈N/Tn⌉
  times, B ⌈M/Tm⌉ times. Footprint: Tm·Tn·acc + (Tm+Tn)·e.
- **input/row-stationary**: a Tm×Tk block of A (rows of the input) stays; B streams past it.
  A is read once; B ⌈M/Tm⌉ times; partial sums spill as in weight-stationary (over ⌈K/Tk⌉).
  (Eyeriss's row-stationary maps 2-D convolution rows to PEs; for a GEMM it reduces to this.)

Tiles are searched over powers of two and the full dimensions. The result shows why tiling changes
traffic: bigger tiles mean fewer re-reads, until they no longer fit. A lower bound for any
schedule is the Hong–Kung bound ≈ 2·M·N·K·e / √(S/e) (Hong & Kung, STOC 1981) plus compulsory
traffic (each operand once).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from ..errors import ConfigError

DATAFLOWS = ("weight_stationary", "output_stationary", "input_stationary")


@dataclass(frozen=True)
class Tiling:
    dataflow: str
    tile: tuple[int, int, int]  # (Tm, Tn, Tk); a full dimension means "not tiled"
    bytes_a: float
    bytes_b: float
    bytes_c: float
    footprint: float

    @property
    def total_bytes(self) -> float:
        return self.bytes_a + self.bytes_b + self.bytes_c

    def to_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}


def traffic(
    dataflow: str, m: int, n: int, k: int, tile: tuple[int, int, int], elem_bytes: float = 2.0, acc_bytes: float = 4.0
) -> Tiling:
    """Off-chip bytes for one dataflow and tile (Tm, Tn, Tk); unused tile entries are ignored."""
    tm, tn, tk = (min(t, d) for t, d in zip(tile, (m, n, k)))
    e, acc = elem_bytes, acc_bytes
    spill_w, spill_r = math.ceil(k / tk), math.ceil(k / tk) - 1
    if dataflow == "weight_stationary":
        a, b = m * k * math.ceil(n / tn) * e, k * n * e
        c = m * n * (spill_w + spill_r) * (acc if spill_r else e)
        foot, tile = tk * tn * e + tk * e + tn * acc, (1, tn, tk)
    elif dataflow == "output_stationary":
        a, b, c = m * k * math.ceil(n / tn) * e, k * n * math.ceil(m / tm) * e, m * n * e
        foot, tile = tm * tn * acc + (tm + tn) * e, (tm, tn, 1)
    elif dataflow == "input_stationary":
        a, b = m * k * e, k * n * math.ceil(m / tm) * e
        c = m * n * (spill_w + spill_r) * (acc if spill_r else e)
        foot, tile = tm * tk * e + tk * e + tm * acc, (tm, 1, tk)
    else:
        raise ConfigError(f"unknown dataflow {dataflow!r}; choose one of {', '.join(DATAFLOWS)}")
    return Tiling(dataflow, tile, float(a), float(b), float(c), float(foot))


def _candidates(dim: int) -> list[int]:
    powers = [1 << i for i in range(dim.bit_length()) if (1 << i) < dim]
    return powers + [dim]


def best_tiling(
    dataflow: str, m: int, n: int, k: int, sram_bytes: float, elem_bytes: float = 2.0, acc_bytes: float = 4.0
) -> Optional[Tiling]:
    """The tile with the least off-chip traffic whose footprint fits in ``sram_bytes`` (None if none fits)."""
    best = None
    for tm in _candidates(m) if dataflow != "weight_stationary" else [1]:
        for tn in _candidates(n) if dataflow != "input_stationary" else [1]:
            for tk in _candidates(k) if dataflow != "output_stationary" else [1]:
                t = traffic(dataflow, m, n, k, (tm, tn, tk), elem_bytes, acc_bytes)
                if t.footprint <= sram_bytes and (
                    best is None or (t.total_bytes, -t.footprint) < (best.total_bytes, -best.footprint)
                ):
                    best = t
    return best


def analyze_gemm(m: int, n: int, k: int, sram_bytes: float, elem_bytes: float = 2.0, acc_bytes: float = 4.0) -> dict:
    """All three dataflows' best tiles for one GEMM, the winner, and the reference bounds."""
    if min(m, n, k) < 1 or sram_bytes <= 0:
        raise ConfigError("GEMM dimensions and the on-chip memory size must be positive")
    flops = 2.0 * m * n * k
    compulsory = (m * k + k * n + m * n) * elem_bytes
    hong_kung = 2.0 * m * n * k * elem_bytes / math.sqrt(max(sram_bytes / elem_bytes, 1.0))
    rows = {}
    for df in DATAFLOWS:
        t = best_tiling(df, m, n, k, sram_bytes, elem_bytes, acc_bytes)
        rows[df] = None if t is None else {**t.to_dict(), "intensity": flops / t.total_bytes}
    fitting = {df: r for df, r in rows.items() if r is not None}
    best = min(fitting, key=lambda df: fitting[df]["total_bytes"]) if fitting else None
    return {
        "m": m,
        "n": n,
        "k": k,
        "sram_bytes": sram_bytes,
        "elem_bytes": elem_bytes,
        "acc_bytes": acc_bytes,
        "flops": flops,
        "compulsory_bytes": compulsory,
        "lower_bound_bytes": max(compulsory, hong_kung),
        "dataflows": rows,
        "best": best,
    }
