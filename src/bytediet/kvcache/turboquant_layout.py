"""TurboQuant channel layouts: which channels get how many bits, within an all-in bit budget.

A layout is ``[(channels, bits), …]`` with the outlier part first; each part is its own TurboQuant
instance (own rotation, codebook and fp16 norm; arXiv 2504.19874 §4.3, "outlier channels"). Each part
costs ``channels · bits + overhead`` bits per vector (overhead: 16 for the MSE variant's norm, 32 for the
inner-product variant's two norms), and the total must not exceed ``target · head_dim``.

* :func:`resolve_layout` — the uncalibrated default (the paper's rule): the largest base width b that fits,
  then as many outlier channels (a multiple of 8) at b + 1 bits as the budget allows.
* :func:`choose_layout` — with calibration: the importance profile of the channels (for keys, the centred
  key variance of each channel times the mean square of the queries that read it, so the quantity is the
  expected score error; for values, the centred variance) tells how much of the energy the top n channels
  hold. A part of energy fraction F quantized at b bits adds F · D(d_part, b) to the relative error
  (D ≈ the Gaussian Lloyd–Max distortion at b bits, cf. Theorem 1), so every feasible two-part layout (outlier bits
  up to 8) is scored by Σ F_part · D_part and the best is taken — reverse water-filling over two groups.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..errors import ConfigError

MAX_PART_BITS = 8
Layout = list[tuple[int, int]]


def overhead_bits(variant: str) -> int:
    return 16 if variant == "mse" else 32


def layout_bits(layout: Layout, variant: str) -> int:
    return sum(n * b + overhead_bits(variant) for n, b in layout)


def _base_bits(target: float, head_dim: int, variant: str) -> int:
    budget = target * head_dim + 1e-9
    base = next((b for b in (4, 3, 2, 1) if head_dim * b + overhead_bits(variant) <= budget), None)
    if base is None:
        need = (head_dim + overhead_bits(variant)) / head_dim
        raise ConfigError(
            f"turboquant{'_prod' if variant == 'prod' else ''}{target:g}: at head_dim {head_dim} the "
            f"smallest layout (1 bit + fp16 norms) needs {need:.3f} bits per coordinate"
        )
    return base


def resolve_layout(target: float, head_dim: int, variant: str) -> Layout:
    """The uncalibrated layout: base width b, plus the most outlier channels at b + 1 that fit."""
    base = _base_bits(target, head_dim, variant)
    budget = target * head_dim + 1e-9
    if base < 4:
        for n in range(head_dim - 8, 0, -8):
            if n * (base + 1) + (head_dim - n) * base + 2 * overhead_bits(variant) <= budget:
                return [(n, base + 1), (head_dim - n, base)]
    return [(head_dim, base)]


def candidate_layouts(target: float, head_dim: int, variant: str) -> list[Layout]:
    """Every single- or two-part layout within the budget (parts a multiple of 8 channels, ≤ 8 bits)."""
    budget = target * head_dim + 1e-9
    lowest = 2 if variant == "prod" else 1  # prod spends one bit on the QJL sign
    out = [[(head_dim, b)] for b in range(lowest, MAX_PART_BITS + 1) if layout_bits([(head_dim, b)], variant) <= budget]
    for n in range(8, head_dim, 8):
        for base in range(lowest, MAX_PART_BITS):
            for hi in range(base + 1, MAX_PART_BITS + 1):
                lay = [(n, hi), (head_dim - n, base)]
                if layout_bits(lay, variant) <= budget:
                    out.append(lay)
    if not out:
        _base_bits(target, head_dim, variant)  # raises the clear error
    return out


# Lloyd–Max distortion of a unit-variance Gaussian (Max 1960) for b = 1…4; Panter–Dite's √3·π/2 · 4^−b above.
# A rotated coordinate of a unit vector in R^d is ≈ N(0, 1/d), so a part's relative error is ≈ this number.
_GAUSSIAN_LLOYD_MAX = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


def part_distortion(bits: int, variant: str) -> float:
    """Predicted relative squared error E‖u − ũ‖² of one part (prod: its MSE stage has b − 1 bits)."""
    b = bits if variant == "mse" else bits - 1
    if b == 0:
        return 1.0
    return _GAUSSIAN_LLOYD_MAX.get(b, 3**0.5 * math.pi / 2 * 4.0**-b)


def choose_layout(target: float, head_dim: int, variant: str, profile: Optional[torch.Tensor]) -> Layout:
    """The layout with the least predicted error for an importance ``profile`` (head_dim,) sorted descending.

    ``profile`` None (uncalibrated) → :func:`resolve_layout`.
    """
    if profile is None:
        return resolve_layout(target, head_dim, variant)
    frac = (profile / profile.sum().clamp(min=1e-30)).cumsum(0)

    def predicted(lay: Layout) -> float:
        if len(lay) == 1:
            return part_distortion(lay[0][1], variant)
        (n, hi), (_, base) = lay
        f = float(frac[n - 1])
        return f * part_distortion(hi, variant) + (1 - f) * part_distortion(base, variant)

    return min(candidate_layouts(target, head_dim, variant), key=predicted)
