"""Transformer building blocks shared by every architecture.

Attention never owns a cache: it receives the layer's :class:`LayerKVCache` and explicit
:class:`AttentionMetadata` (positions, slot mapping, block tables, context lengths).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError
from ..kernels import backend, ops
from ..kvcache.base import AttentionMetadata, LayerKVCache
from ..quant.base import Packed, WeightFormat
from ..quant.common import ACTIVATION_MODES


class Linear(nn.Module):
    """A linear layer whose weight is stored in a :class:`WeightFormat` (vLLM's ``quant_method.apply``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.format: Optional[WeightFormat] = None
        self._packed_keys: list[str] = []
        self.interleaved: Optional[torch.Tensor] = None  # a row-interleaved copy for the native kernels, if any
        self._native: Optional[tuple[int, torch.Tensor]] = None  # format.native_layout, made on first use
        self._device_weight: Optional[tuple] = None  # (backend.DeviceWeight or None,): the GPU path's, made once
        self.dropped_plane_bytes = 0  # the packed planes' bytes once only the native copy is kept (keep_native_only)

    @property
    def packed(self) -> Packed:
        return {k: getattr(self, "packed_" + k) for k in self._packed_keys}

    def set_packed(self, fmt: WeightFormat, packed: Packed) -> None:
        """Install already-packed tensors (from a quantizer or a saved checkpoint)."""
        for k in self._packed_keys:
            delattr(self, "packed_" + k)
        self.dropped_plane_bytes = 0
        self.format, self._packed_keys, self.interleaved, self._native = fmt, list(packed), None, None
        self._device_weight = None
        for k, t in packed.items():
            self.register_buffer("packed_" + k, t, persistent=True)

    def set_weight(self, weight: torch.Tensor, fmt: WeightFormat, stats=None) -> None:
        """Quantize a float weight (out_features, in_features) with ``fmt`` and install it."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {tuple(weight.shape)} != ({self.out_features}, {self.in_features})")
        self.set_packed(fmt, fmt.quantize(weight, stats))

    @property
    def planes_dropped(self) -> bool:
        """Whether only the native copy is kept (:meth:`keep_native_only`)."""
        return self.dropped_plane_bytes > 0

    def dequantized_weight(self) -> torch.Tensor:
        if self.planes_dropped:  # decode the native copy
            return ops.dequantize_blocks(*self._native)
        return self.format.dequantize(self.packed)

    def keep_native_only(self, dtype: torch.dtype = torch.float32) -> bool:
        """Drop the packed planes once the kernels' repacked copy exists (``bytediet optimize``'s measured
        candidates; the engine's own model on the GPU path): the native CPU kernels or the Triton GEMM multiply
        the copy, and :meth:`dequantized_weight` decodes the values they multiply, so the layer costs its bytes
        once (``weight_bytes`` still counts the format's bytes, kept in :attr:`dropped_plane_bytes`). False where
        there is no separate copy (GGML blocks are read in place; FP8 / 2:4 tensor-core weights keep theirs), or
        no kernel. ``dtype``: the activations' on the GPU path (its prepared weight is made for them)."""
        native = self._device_layout(dtype) if backend.triton_selected(self._probe()) else self.native_weight()
        if native is None or not self._packed_keys:
            return False
        if any(t.untyped_storage().data_ptr() == native[1].untyped_storage().data_ptr() for t in self.packed.values()):
            return False
        self._native = native
        self.dropped_plane_bytes = sum(t.numel() * t.element_size() for t in self.packed.values())
        for k in self._packed_keys:
            delattr(self, "packed_" + k)
        self._packed_keys = []
        return True

    def _probe(self) -> torch.Tensor:
        """An empty tensor where the weight lives: what ``backend.triton_selected`` decides the path by."""
        return torch.empty(0, device=self.packed_device())

    def _device_layout(self, dtype: torch.dtype) -> Optional[tuple[int, torch.Tensor]]:
        """(type id, rows) the GPU path's Triton GEMM reads for this layer, or None (float, FP8 / 2:4 weights)."""
        weight = self.device_weight(dtype)
        return None if weight is None or weight.blocks is None else (weight.type_id, weight.blocks)

    def drop_native(self) -> None:
        """Let go of the native kernels' repacked copy (made again on the next product) while the planes are kept."""
        if not self.planes_dropped:
            self._native = None

    def native_weight(self) -> Optional[tuple[int, torch.Tensor]]:
        """(kernel type id, rows) that a native block kernel multiplies on this machine, or None.

        GGML blocks are the packed tensor itself; bytediet's int8/int4 planes are repacked once, here, into
        a copy of the same byte count (``kernels/native_layouts.py``), kept beside the packed planes.
        """
        if self.format is None or self.packed_device().type != "cpu":
            return None
        if self._native is None:
            layout = self.format.native_layout(self.packed)
            if layout is None or not ops.has_native_gemm(layout[0], k=self.in_features):
                return None
            self._native = (layout[0], layout[1].contiguous())
        return self._native

    def device_weight(self, dtype: torch.dtype = torch.float32) -> Optional[backend.DeviceWeight]:
        """The weight as the GPU path multiplies it (kernels/backend.py: the Triton GEMM over the format's block
        layout, or FP8 / 2:4 tensor cores on CUDA), made once for activations of ``dtype`` on the weight's
        device; None for a float weight (F.linear) or a format with no block layout (refused at engine start)."""
        if getattr(self.format, "activations", None) not in (None, *ACTIVATION_MODES):  # int8-w8a8's, by definition
            raise ConfigError(
                f"{self.format.spec()} rounds its activations ({self.format.activations}), which no GPU kernel does; "
                "run it with --device cpu, or use int8 (W8A16) or fp8 (W8A8 on FP8 tensor cores) on the GPU"
            )
        if self._device_weight is None:
            layout = self._native if self.planes_dropped else None  # the only copy left: the kernels' layout
            if layout is None and self.format is not None:
                layout = _layout_on(self.format, self.packed, self.packed_device())
            self._device_weight = (None if layout is None else backend.prepare(layout[0], layout[1], dtype),)
        return self._device_weight[0]

    def packed_device(self) -> torch.device:
        if self.planes_dropped:
            return self._native[1].device
        return getattr(self, "packed_" + self._packed_keys[0]).device if self._packed_keys else torch.device("cpu")

    def _apply_format(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The format's own product (no native kernel for this input), from the decoded copy once planes are dropped."""
        if self.planes_dropped:
            return F.linear(x, self.dequantized_weight().to(x.dtype), bias)
        return self.format.apply(x, self.packed, bias)

    def weight(self, triton: bool = False) -> ops.LinearWeight:
        """This layer's weight as the kernels choose a product for it (``ops.linear``); ``triton``: for the GPU path
        (kernels/backend.py), which multiplies the weight as :meth:`device_weight` prepares it."""
        if triton:
            return ops.LinearWeight(
                self.in_features,
                self.out_features,
                None,
                self._apply_format,
                device=self.device_weight,
            )
        return ops.LinearWeight(
            self.in_features,
            self.out_features,
            getattr(self.format, "activations", None),
            self._apply_format,
            self.native_weight(),
            self.interleaved,
            getattr(self.format, "ggml_type", None),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(self.weight(backend.triton_selected(x)), x, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}→{self.out_features}, format={self.format.spec() if self.format else None}"


class PackedEmbedding(nn.Module):
    """A token embedding kept in a checkpoint's GGML blocks (``bytediet optimize``): a lookup gathers the ids' rows
    of bytes and decodes only those (``ops.dequantize_blocks``, the decoder the block kernels use), so the table
    costs its blocks — shared with a tied ``lm_head`` — not vocab × hidden float32. Rows decode to the float32
    values of the dequantized table."""

    def __init__(self, fmt: WeightFormat, blocks: torch.Tensor, embedding_dim: int) -> None:
        super().__init__()
        self.format, self.ggml_type = fmt, int(fmt.ggml_type)  # a GGUFBlocks format
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim
        self.register_buffer("packed_blocks", blocks, persistent=True)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.packed_blocks.device

    @property
    def weight(self) -> torch.Tensor:
        """The whole table in float32, decoded now (for code that needs it whole, e.g. saving a checkpoint)."""
        return ops.dequantize_blocks(self.ggml_type, self.packed_blocks)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.packed_blocks.index_select(0, input_ids.reshape(-1))
        return ops.dequantize_blocks(self.ggml_type, rows).reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}×{self.embedding_dim}, ggml type {self.ggml_type}"


def _layout_on(fmt: WeightFormat, packed: Packed, device: torch.device) -> Optional[tuple[int, torch.Tensor]]:
    """``fmt.native_layout(packed)`` on ``device``: repacked there, or on the CPU and moved where a packing step
    has no kernel on the device."""
    try:
        return fmt.native_layout(packed)
    except RuntimeError:  # a repack written for CPU tensors (device mismatch)
        if device.type == "cpu":
            raise
        layout = fmt.native_layout({k: t.cpu() for k, t in packed.items()})
        return None if layout is None else (layout[0], layout[1].to(device))


class RMSNorm(nn.Module):
    """y = x / rms(x) · w. Gemma's "(1 + w)" is folded into w at load time (GGUF already stores it so)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)  # one native pass on CPU float32, else the reference


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (Su et al. 2021, arXiv 2104.09864) with optional llama3 / linear frequency scaling."""

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict] = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        inv_freq = _scale_frequencies(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self._cached: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (T, H, D), positions: (T,) → rotated x."""
        return self._rotate(x, positions, 1.0)

    def inverse(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Undo :meth:`forward` (rotate by −θ): the pre-RoPE vectors of ``x`` (T, H, D) at ``positions`` (T,)."""
        return self._rotate(x, positions, -1.0)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions (T,) × inv_freq: (T, 1, D/2) each, computed once per step: every layer (and q
        and k) of a step passes the same ``positions`` tensor, so the last one is kept (by identity — a new
        step's tensor is a new object)."""
        if self._cached is None or self._cached[0] is not positions:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, D/2)
            self._cached = (positions, freqs.cos()[:, None, :], freqs.sin()[:, None, :])
        return self._cached[1], self._cached[2]

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, sign: float) -> torch.Tensor:
        cos, sin = self.cos_sin(positions)
        sin = sin if sign > 0 else -sin
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _scale_frequencies(inv_freq: torch.Tensor, scaling: Optional[dict]) -> torch.Tensor:
    if not scaling:
        return inv_freq
    kind = scaling.get("type") or scaling.get("rope_type")
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":  # Llama 3.1 frequency-dependent scaling
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * torch.pi / inv_freq
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    if kind in (None, "default", "none"):
        return inv_freq
    raise ValueError(f"unsupported rope scaling type {kind!r} (linear and llama3 are supported)")


class Attention(nn.Module):
    """Grouped-query attention over a paged KV cache; optional q/k RMSNorm per head (gemma3) or over the
    whole projection (``qk_norm_per_head=False``, olmoe), q/k/v bias (qwen2), output bias and a q/k/v
    clamp (``clip``, olmoe)."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool,
        qk_norm_eps: Optional[float],
        rope: RotaryEmbedding,
        scale: float,
        window: Optional[int],
        qk_norm_per_head: bool = True,
        clip: Optional[float] = None,
        out_bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(hidden, num_heads * head_dim, bias)
        self.k_proj = Linear(hidden, num_kv_heads * head_dim, bias)
        self.v_proj = Linear(hidden, num_kv_heads * head_dim, bias)
        self.o_proj = Linear(num_heads * head_dim, hidden, out_bias)
        q_dim, k_dim = (head_dim, head_dim) if qk_norm_per_head else (num_heads * head_dim, num_kv_heads * head_dim)
        self.q_norm = RMSNorm(q_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(k_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.qk_norm_per_head, self.clip = qk_norm_per_head, clip
        self.rope, self.scale, self.window = rope, scale, window

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: LayerKVCache) -> torch.Tensor:
        t = x.shape[0]  # x: (T, hidden)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (T, H·D), (T, KV·D), (T, KV·D)
        if self.q_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (a.clamp(-self.clip, self.clip) for a in (q, k, v))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, meta.positions), self.rope(k, meta.positions)
        cache.write(k, v, meta.slot_mapping, meta.positions)
        out = cache.attend(q, meta, self.scale, self.window)  # (T, H, D)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) · up(x)), act = SiLU (llama, qwen2) or GELU-tanh (gemma3)."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.act = F.silu if act == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
        self.gelu = act != "silu"  # act(gate) · up as one native pass: ops.gelu_tanh_mul (gemma3), ops.silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(ops.gelu_tanh_mul(gate, up) if self.gelu else ops.silu_mul(gate, up))
