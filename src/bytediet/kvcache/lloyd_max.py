"""Lloyd–Max (MSE-optimal) scalar codebooks for a known 1-D density, computed once and cached.

Used by TurboQuant (coordinates of a uniformly random unit vector in R^d, density
∝ (1 − x²)^((d−3)/2) on [−1, 1]; arXiv 2504.19874 Lemma 1) and PolarQuant (angles with density
∝ sin^(k)(2ψ) on [0, π/2]; arXiv 2502.02617 Lemma 2). The density is discretised on a fine grid and the
classic Lloyd iteration (centroid ↔ midpoint boundaries) is run to convergence in float64.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

_GRID = 40001


def _lloyd(x: np.ndarray, w: np.ndarray, levels: int, iters: int = 3000) -> tuple[np.ndarray, float]:
    """x: grid points, w: probability weights (sum 1) → (sorted centroids, expected squared error)."""
    cdf = np.cumsum(w)
    centroids = np.interp((np.arange(levels) + 0.5) / levels, cdf, x)  # start at the quantiles
    for _ in range(iters):
        bounds = (centroids[1:] + centroids[:-1]) / 2
        cell = np.searchsorted(bounds, x)
        mass = np.bincount(cell, w, levels)
        new = np.where(mass > 0, np.bincount(cell, w * x, levels) / np.maximum(mass, 1e-300), centroids)
        if np.max(np.abs(new - centroids)) < 1e-12:
            centroids = new
            break
        centroids = new
    cell = np.searchsorted((centroids[1:] + centroids[:-1]) / 2, x)
    mse = float(np.sum(w * (x - centroids[cell]) ** 2))
    return centroids, mse


@lru_cache(maxsize=None)
def sphere_coordinate_codebook(d: int, bits: int) -> tuple[torch.Tensor, float]:
    """Codebook (2**bits,) float32 for one coordinate of a random unit vector in R^d, and its MSE per coordinate.

    The MSE of a whole unit vector is ``d * mse`` (TurboQuant's D_mse: ≈ 0.363, 0.117, 0.0345, 0.0095 for b = 1…4).
    """
    if d < 2:
        raise ValueError("sphere codebook needs d >= 2")
    x = np.linspace(-1.0, 1.0, _GRID)
    with np.errstate(divide="ignore"):
        logw = (d - 3) / 2 * np.log(np.clip(1 - x * x, 1e-300, None))
    w = np.exp(logw - logw.max())
    w /= w.sum()
    c, mse = _lloyd(x, w, 2**bits)
    return torch.tensor(c, dtype=torch.float32), mse


@lru_cache(maxsize=None)
def sine_power_codebook(power: int, bits: int) -> torch.Tensor:
    """Codebook (2**bits,) on [0, π/2] for the density ∝ sin(2ψ)^power (PolarQuant angles, level ≥ 2)."""
    x = np.linspace(0.0, np.pi / 2, _GRID)
    w = np.sin(2 * x) ** power
    w /= w.sum()
    c, _ = _lloyd(x, w, 2**bits)
    return torch.tensor(c, dtype=torch.float32)


def nearest(values: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest codebook entry (sorted codebook) for every element of ``values``."""
    bounds = (codebook[1:] + codebook[:-1]) / 2
    return torch.bucketize(values.contiguous(), bounds.to(values.device))
