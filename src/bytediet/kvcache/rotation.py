"""Random orthogonal transforms for rotation-based codecs (TurboQuant, PolarQuant, QJL sketches).

Both kinds are returned as a dense (d, d) float32 matrix R with ``R @ R.T = I``; a vector x is
rotated as ``x @ R.T`` and restored as ``y @ R``. A dense d×d matmul is what a GPU kernel would use for
head dims ≤ 256 anyway; the fast Walsh–Hadamard transform only pays off for much larger d.

* ``"hadamard"`` — randomized Hadamard ``H_d · diag(s) / √d`` with random signs s (needs d a power of two);
* ``"qr"`` — a Haar-random orthogonal matrix from the QR decomposition of a Gaussian matrix
  (sign-corrected so that the distribution is exactly Haar; Mezzadri 2007).

``random_rotation(d, "hadamard", …)`` with d not a power of two **falls back to "qr"** (documented
behaviour; padding would add stored coordinates). ``rotation_kind(d, kind)`` tells which one is used.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError

ROTATIONS = ("hadamard", "qr")


def _is_pow2(d: int) -> bool:
    return d > 0 and d & (d - 1) == 0


def rotation_kind(d: int, kind: str) -> str:
    if kind not in ROTATIONS:
        raise ConfigError(f"unknown rotation {kind!r}; choose one of: {', '.join(ROTATIONS)}")
    return kind if kind == "qr" or _is_pow2(d) else "qr"


def hadamard(d: int) -> torch.Tensor:
    """Sylvester Hadamard matrix (d, d) of ±1, d a power of two."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def random_rotation(d: int, kind: str, seed: int) -> torch.Tensor:
    """A (d, d) float32 orthogonal matrix, deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    if rotation_kind(d, kind) == "hadamard":
        signs = torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1
        return hadamard(d) * signs[None, :] / d**0.5
    g = torch.randn(d, d, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    q = q * torch.sign(torch.diagonal(r))[None, :]
    return q.float()


def gaussian_sketch(m: int, d: int, seed: int) -> torch.Tensor:
    """A (m, d) matrix of i.i.d. N(0, 1) entries (the JL sketch of QJL, arXiv 2406.03482)."""
    return torch.randn(m, d, generator=torch.Generator().manual_seed(seed))
