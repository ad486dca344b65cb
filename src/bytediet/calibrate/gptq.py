"""GPTQ: second-order error compensation while rounding, into the int4 format (Frantar et al. 2022, arXiv 2210.17323).

Each linear layer minimises ‖X Wᵀ − X Ŵᵀ‖² over calibration inputs X (T, in), whose Hessian per
output row is H = 2 XᵀX / T. Columns are quantized left to right; after rounding column i the error
(w_i − q_i) / [H⁻¹]_ii is spread over the columns not yet quantized through row i of the upper Cholesky
factor of H⁻¹ (Algorithm 1). Updates are applied lazily: inside a block of ``block_size`` columns
immediately, to the columns beyond it once per block. Damping adds ``damp`` × mean(diag H) to the
diagonal; inputs that never fire (H_ii = 0) get H_ii = 1 and a zero weight column.

Groups: each group of ``group_size`` input columns gets its scale (and offset) exactly as the
:class:`~bytediet.quant.int4.Int4` format computes them — fp16, from the group's weights as updated by the error
feedback when the first column of the group is reached (``block_size`` is a multiple of the group
size, so the whole group is inside the current block). With ``act_order`` columns are visited by
decreasing H_ii and the group parameters come from the original weights (GPTQ's "static groups"),
so that the groups remain the format's contiguous column ranges. The result is the format's own
packed tensors, so ``apply``/save/load/export work unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..errors import ConfigError
from ..models.quantize import QuantizeConfig
from ..quant import Packed
from ..quant.fp4 import pack_nibbles
from ..quant.int4 import Int4
from .base import CALIBRATION_METHODS, Progress, no_progress, pack_blocks_in_order


@dataclass(frozen=True)
class GPTQConfig:
    block_size: int = 128
    damp: float = 0.01
    act_order: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or not 0.0 <= self.damp < 1.0:
            raise ConfigError(f"GPTQ needs block_size >= 1 and 0 <= damp < 1, got {self.block_size}, {self.damp}")

    def to_dict(self) -> dict:
        return asdict(self)


class GroupQuantizer:
    """The int4 format's group grid: ``params(w)`` for (out, g) columns, ``codes``/``dequant`` per column."""

    def __init__(self, fmt: Int4) -> None:
        self.symmetric = fmt.symmetric

    def params(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, group) weights → fp16-rounded (scale, offset) (out,), as :meth:`Int4.quantize` stores them."""
        if self.symmetric:
            scale = (g.float().abs().amax(1) / 7).half()
            return scale, torch.zeros_like(scale)
        lo, hi = g.float().amin(1), g.float().amax(1)
        return ((hi - lo) / 15).half(), lo.half()

    def codes(self, w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """(out,) column → stored codes 0..15 (float64)."""
        s = scale.double()
        inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
        if self.symmetric:
            return torch.round(w * inv).clamp(-7, 7) + 8
        return torch.round((w - offset.double()) * inv).clamp(0, 15)

    def dequant(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        if self.symmetric:
            return (q - 8) * scale.double()
        return q * scale.double() + offset.double()


def inverse_hessian_factor(h: torch.Tensor, damp: float, method: str = "GPTQ", overwrite: bool = False) -> torch.Tensor:
    """Upper Cholesky factor U of (H + λI)⁻¹ (so U_ii² = [H⁻¹]_ii of the remaining columns), λ = damp·mean diag H.

    ``overwrite``: the factorisation runs in ``h``'s own storage (a working copy its caller no longer needs), so
    it holds one in × in matrix instead of four (a 4864-wide float64 Hessian is 189 MB)."""
    h = (h if overwrite else h.clone()).mT  # H is symmetric: its column-major view is LAPACK's own layout
    h.diagonal().add_(damp * h.diagonal().mean())
    _, info = torch.linalg.cholesky_ex(h, out=(h, torch.empty(0, dtype=torch.int32, device=h.device)))
    if int(info):
        raise ConfigError(
            f"{method}: the Hessian is not positive definite even after damping; raise the damping "
            f"({method}Config.damp) or use more calibration tokens"
        )
    torch.cholesky_inverse(h, out=h)
    return torch.linalg.cholesky(h, upper=True, out=h)


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, fmt: Int4, config: GPTQConfig = GPTQConfig()) -> Packed:
    """weight (out, in), hessian (in, in) → the int4 format's packed tensors (qweight, scale[, offset])."""
    if not isinstance(fmt, Int4):
        raise ConfigError(f"GPTQ writes the int4-gN formats; {fmt.spec()} is not one (quantize it without GPTQ)")
    gs = fmt.group_size
    out, k = weight.shape
    if k % gs:
        raise ConfigError(f"{fmt.spec()}: group size {gs} does not divide in_features ({k})")
    if config.block_size % gs:
        raise ConfigError(f"GPTQ block size {config.block_size} must be a multiple of the group size {gs}")
    quant = GroupQuantizer(fmt)
    w = weight.double().clone()
    h = hessian.double().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    dev = w.device  # every buffer where the weight is (a GPU with quantize --device cuda)
    perm = (
        torch.argsort(h.diagonal(), descending=True, stable=True) if config.act_order else torch.arange(k, device=dev)
    )
    scales = torch.zeros(out, k // gs, dtype=torch.float16, device=dev)
    offsets = torch.zeros_like(scales)
    if config.act_order:  # static groups: parameters from the original (dead-zeroed) weights
        for g in range(k // gs):
            scales[:, g], offsets[:, g] = quant.params(w[:, g * gs : (g + 1) * gs])
    if config.act_order:  # one permuted copy at a time
        w, h = w[:, perm], h[perm]
        h = h[:, perm]
    u = inverse_hessian_factor(h, config.damp, overwrite=True)
    codes = torch.zeros(out, k, dtype=torch.float64, device=dev)
    groups = (perm // gs).tolist()  # column → its group, read once (not one device sync per column)
    for b0 in range(0, k, config.block_size):
        b1 = min(b0 + config.block_size, k)
        w1, err1 = w[:, b0:b1].clone(), torch.zeros(out, b1 - b0, dtype=torch.float64, device=dev)
        for i in range(b1 - b0):
            col = b0 + i
            group = groups[col]
            if not config.act_order and col % gs == 0:  # first column of a group: its parameters, now
                scales[:, group], offsets[:, group] = quant.params(w1[:, i : i + gs])
            q = quant.codes(w1[:, i], scales[:, group], offsets[:, group])
            codes[:, col] = q
            e = (w1[:, i] - quant.dequant(q, scales[:, group], offsets[:, group])) / u[col, col]
            w1[:, i:] -= e[:, None] * u[col, col:b1][None, :]
            err1[:, i] = e
        w[:, b1:] -= err1 @ u[b0:b1, b1:]  # the lazy update of every later column
    codes = codes[:, torch.argsort(perm)]
    packed = {"qweight": pack_nibbles(codes.to(torch.uint8)), "scale": scales}
    if not fmt.symmetric:
        packed["offset"] = offsets
    return packed


def gptq_model(
    model,
    config: QuantizeConfig,
    windows: torch.Tensor,
    gptq: GPTQConfig = GPTQConfig(),
    progress: Progress = no_progress,
) -> tuple[dict[str, Packed], dict]:
    """GPTQ for every int4 layer inside the decoder blocks → ({layer: packed}, record).

    Blocks run in order on calibration windows (N, L); block i's Hessians come from the outputs of the
    already-quantized blocks 0..i−1 (the paper's sequential scheme). Block layers of other formats are
    rounded to nearest. The model's weights are restored afterwards: install the result with
    ``quantize(model, config, prepacked=result)``.
    """

    def pack(w, fmt, stats):
        return gptq_quantize(w, stats.take_hessian(), fmt, gptq) if stats is not None else fmt.quantize(w)

    result = pack_blocks_in_order(
        model, config, windows, progress, "GPTQ: quantizing blocks", lambda fmt: isinstance(fmt, Int4), pack
    )
    return result, {"method": "gptq", **gptq.to_dict()}


@CALIBRATION_METHODS.register("gptq")
def run_gptq(model, config: QuantizeConfig, windows: torch.Tensor, progress: Progress = no_progress, **settings):
    """The registered method: GPTQ-packed int4 layers for ``quantize(..., prepacked=)``; :class:`GPTQConfig` fields."""
    return gptq_model(model, config, windows, GPTQConfig(**settings), progress)


run_gptq.candidate_formats = ("int4",)  # the families `bytediet optimize` calibrates with it
