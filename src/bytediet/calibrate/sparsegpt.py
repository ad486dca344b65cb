"""SparseGPT: prune to a sparsity pattern while updating the kept weights (Frantar & Alistarh 2023, arXiv 2301.00774).

Each linear layer minimises ‖X Wᵀ − X Ŵᵀ‖² over calibration inputs X (T, in) with half of each row's
weights forced to zero, using the Hessian H = 2 XᵀX / T of GPTQ (:mod:`bytediet.calibrate.gptq`).
Columns are visited left to right. For a pruned weight w_c the Optimal Brain Surgeon update
(Hassibi & Stork 1993) that keeps the layer output closest moves the not-yet-visited weights of the row
by −w_c / [H_F⁻¹]_cc · [H_F⁻¹]_c,: where F are the columns from c onwards; with U the upper Cholesky
factor of H⁻¹, [H_F⁻¹]_cc = U_cc² and the update is −(w_c / U_cc) · U_c,c: (Algorithm 1). Kept weights are
not changed at their own column, but absorb the updates of every pruned weight to their left.

Mask selection (§3.2, "adaptive mask selection"): at the start of every span the OBS saliency
w_j² / U_jj² of the span's columns — computed on the weights as updated so far — decides which half of
each row's span is pruned (the smaller saliencies). For 2:4 (``sparse24``, ``sparse24-int8``) the span is
a group of 4 (§3.3, "semi-structured N:M"); for ``sparse50`` it is each lazy block of ``block_size``
columns, per row. Updates beyond the current block are applied lazily, once per block; damping adds
``damp`` × mean(diag H) to the diagonal; inputs that never fire (H_jj = 0) get H_jj = 1 and a zero
weight column, as in GPTQ.

For ``sparse24-int8`` the kept weights are rounded to the format's per-row int8 grid after pruning (the
paper folds the rounding into the same pass; that is not done here).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..errors import ConfigError
from ..models.quantize import QuantizeConfig, build_format
from ..quant import Packed
from ..quant.pruning import PrunedFormat
from .base import CALIBRATION_METHODS, Progress, no_progress, pack_blocks_in_order, require_windows
from .gptq import inverse_hessian_factor


@dataclass(frozen=True)
class SparseGPTConfig:
    block_size: int = 128
    damp: float = 0.01

    def __post_init__(self) -> None:
        if self.block_size < 4 or self.block_size % 4 or not 0.0 <= self.damp < 1.0:
            raise ConfigError(
                f"SparseGPT needs block_size a positive multiple of 4 and 0 <= damp < 1, "
                f"got {self.block_size}, {self.damp}"
            )

    def to_dict(self) -> dict:
        return asdict(self)


def saliency(w: torch.Tensor, u_diag: torch.Tensor) -> torch.Tensor:
    """OBS saliency w_j² / [H_F⁻¹]_jj = w_j² / U_jj² for (out, n) weights and the (n,) Cholesky diagonal."""
    return w.pow(2) / u_diag.pow(2)[None, :]


@torch.no_grad()
def sparsegpt_prune(
    weight: torch.Tensor, hessian: torch.Tensor, fmt: PrunedFormat, config: SparseGPTConfig = SparseGPTConfig()
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in), hessian (in, in) → (pruned weight (out, in) float64, keep mask (out, in) bool)."""
    w = fmt.check(weight).double()
    out, k = w.shape
    h = hessian.double().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    u = inverse_hessian_factor(h, config.damp, "SparseGPT", overwrite=True)
    keep = torch.ones(out, k, dtype=torch.bool, device=w.device)  # every buffer where the weight is
    span = fmt.span
    for b0 in range(0, k, config.block_size):
        b1 = min(b0 + config.block_size, k)
        w1, err1, u1 = (
            w[:, b0:b1].clone(),
            torch.zeros(out, b1 - b0, dtype=torch.float64, device=w.device),
            u[b0:b1, b0:b1],
        )
        d = u1.diagonal()
        if span is None:  # one selection per row for the whole block
            keep[:, b0:b1] = fmt.select(saliency(w1, d))
        for i in range(b1 - b0):
            if span is not None and i % span == 0:
                keep[:, b0 + i : b0 + i + span] = fmt.select(saliency(w1[:, i : i + span], d[i : i + span]))
            e = torch.where(keep[:, b0 + i], 0.0, w1[:, i]) / d[i]  # only pruned weights move the rest
            w1[:, i:] -= e[:, None] * u1[i, i:][None, :]
            err1[:, i] = e
        w[:, b0:b1] = w1.masked_fill(~keep[:, b0:b1], 0.0)
        w[:, b1:] -= err1 @ u[b0:b1, b1:]  # the lazy update of every later column
    return w, keep


def sparsegpt_model(
    model,
    config: QuantizeConfig,
    windows: torch.Tensor,
    sparsegpt: SparseGPTConfig = SparseGPTConfig(),
    progress: Progress = no_progress,
) -> tuple[dict[str, Packed], dict]:
    """SparseGPT for every pruned layer (2:4 or 50 %) inside the decoder blocks → ({layer: packed}, record).

    Blocks run in order on calibration windows (N, L); block i's Hessians come from the outputs of the
    already-pruned blocks 0..i−1 (the paper's sequential scheme, §3.4). Block layers of other formats
    are rounded to nearest. The model's weights are restored afterwards: install the result with
    ``quantize(model, config, prepacked=result)``.
    """
    require_windows(windows, "sparsegpt")
    specs = {config.spec_for(name) for name, _ in model.linear_layers()} - {None}
    if not any(isinstance(build_format(s), PrunedFormat) for s in specs):
        raise ConfigError(
            "sparsegpt prunes sparse layers: use --format sparse24, sparse24-int8 or sparse50 "
            f"(this config has {', '.join(sorted(specs))})"
        )

    def pack(w, fmt, stats):
        if not isinstance(fmt, PrunedFormat):
            return fmt.quantize(w)
        pruned, keep = sparsegpt_prune(w, stats.take_hessian(), fmt, sparsegpt)
        return fmt.pack(pruned.float(), keep)

    result = pack_blocks_in_order(
        model, config, windows, progress, "SparseGPT: pruning blocks", lambda fmt: isinstance(fmt, PrunedFormat), pack
    )
    return result, {"method": "sparsegpt", **sparsegpt.to_dict()}


@CALIBRATION_METHODS.register("sparsegpt")
def run_sparsegpt(model, config: QuantizeConfig, windows: torch.Tensor, progress: Progress = no_progress, **settings):
    """The registered method: SparseGPT-pruned layers for ``quantize(..., prepacked=)``; :class:`SparseGPTConfig`."""
    return sparsegpt_model(model, config, windows, SparseGPTConfig(**settings), progress)


run_sparsegpt.candidate_formats = ("sparse24", "sparse24-int8")  # the families `bytediet optimize` calibrates with it
