"""The decoder-only transformer shared by the llama, qwen2, gemma3 and mixture-of-experts families.

Module names follow Hugging Face (``model.layers.3.self_attn.q_proj``) so HF checkpoints map 1:1
and per-module overrides read naturally. The forward pass works on a flat ragged batch of tokens
with explicit paged-attention metadata; it never owns a KV cache.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
import torch.nn as nn

from ..config import ModelConfig
from ..kvcache.base import AttentionMetadata, KVCodec, LayerKVCache, default_block_size, get_kv_codec
from .layers import MLP, Attention, Linear, PackedEmbedding, RMSNorm, RotaryEmbedding
from .moe import SparseMoE


class DecoderLayer(nn.Module):
    """Pre-norm block; gemma3 adds "sandwich" norms after attention and after the MLP."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        rope = RotaryEmbedding(
            config.head_dim,
            config.rope_theta_for(layer),
            None if config.layer_types[layer] == "sliding" else config.rope_scaling,
        )
        self.self_attn = Attention(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            bias=config.attention_bias,
            qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
            rope=rope,
            scale=config.attention_scale,
            window=config.window_for(layer),
            qk_norm_per_head=config.qk_norm_per_head,
            clip=config.clip_qkv,
            out_bias=config.attention_out_bias,
        )
        if config.is_moe_layer(layer):
            self.mlp = SparseMoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.sandwich = config.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: LayerKVCache) -> torch.Tensor:
        if self.sandwich:  # gemma3: x + post_norm(attn(norm(x))), then the same around the MLP
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), meta, cache))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), meta, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """Embeddings, layers and final norm (HF's ``model.``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # created on "meta": the loader assigns the real tensor (no transient vocab × hidden allocation)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device="meta")
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """A causal language model over a paged KV cache.

    ``forward(input_ids (T,), meta, caches) → logits (N, vocab)`` for the N rows in ``logits_indices``
    (all T rows when None).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        # tensor parallel (set by bytediet.distributed.shard.install): (rank, world) and this rank's KV heads
        self.tensor_parallel: Optional[tuple[int, int]] = None
        self.kv_head_range: Optional[tuple[int, int]] = None

    @property
    def dtype(self) -> torch.dtype:
        table = self.model.embed_tokens
        return table.dtype if isinstance(table, PackedEmbedding) else table.weight.dtype

    @property
    def device(self) -> torch.device:
        table = self.model.embed_tokens
        return table.device if isinstance(table, PackedEmbedding) else table.weight.device

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        caches: list[LayerKVCache],
        logits_indices: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer, cache in zip(self.model.layers, caches):
            x = layer(x, meta, cache)
        if logits_indices is not None:
            x = x[logits_indices]
        return self.head(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states after the last layer (N, hidden) → float32 logits (N, vocab)."""
        return self.lm_head(self.model.norm(x)).float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings times the architecture's scale (gemma3: √hidden): (...) ids → (..., hidden)."""
        x = self.model.embed_tokens(input_ids)
        if self.config.embedding_scale != 1.0:
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        return x

    def weight_formats(self) -> list[str]:
        """The distinct weight formats of the linear layers, sorted (e.g. ``["fp32", "int8"]``)."""
        return sorted({lin.format.spec() for _, lin in self.linear_layers()})

    def rope(self, layer: int) -> RotaryEmbedding:
        """The rotary embedding of ``layer``'s attention (gemma3's local and global layers differ)."""
        return self.model.layers[layer].self_attn.rope

    def linear_layers(self) -> Iterator[tuple[str, Linear]]:
        """Every weight-format-carrying linear layer, with its qualified name."""
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                yield name, module

    def weight_bytes(self) -> int:
        """Bytes of every parameter and packed buffer the forward pass reads (tied tensors once)."""
        seen, total = set(), 0
        lm_head = {t.data_ptr() for t in self.lm_head.packed.values()}
        table = self.model.embed_tokens
        table = table.packed_blocks if isinstance(table, PackedEmbedding) else table.weight
        if table.data_ptr() not in lm_head:  # an untied lookup table: a step reads only its tokens' rows
            seen.add(table.data_ptr())
        for t in list(self.parameters()) + list(self.buffers()):
            if t.data_ptr() in seen or t.numel() == 0:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return total + sum(getattr(m, "dropped_plane_bytes", 0) for m in self.modules())  # keep_native_only

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one single-token step reads: :meth:`weight_bytes` less, in each MoE layer, the
        E − k experts the token is not routed to (each expert's bytes averaged: formats may differ per
        expert). Equal to :meth:`weight_bytes` for a dense model; the numerator of achieved GB/s."""
        total = float(self.weight_bytes())
        for layer in self.model.layers:
            if isinstance(layer.mlp, SparseMoE):
                sizes = [
                    sum(t.numel() * t.element_size() for t in (*e.parameters(), *e.buffers()))
                    for e in layer.mlp.experts
                ]
                total -= (len(sizes) - layer.mlp.top_k) * sum(sizes) / len(sizes)
        return int(total)

    def new_caches(
        self, num_blocks: int, block_size: int = 16, kv_codec: "str | KVCodec" = "auto"
    ) -> list[LayerKVCache]:
        """Allocate one paged cache per layer with the named codec (or the codec object the engine built)."""
        codec = get_kv_codec(kv_codec, self.dtype)
        if self.kv_head_range is not None:  # a tensor-parallel shard: per-head codec state for its heads only
            codec = codec.for_heads(*self.kv_head_range)
        c = self.config
        return [
            codec.create_cache(i, num_blocks, block_size, c.num_kv_heads, c.head_dim, self.dtype, self.device)
            for i in range(c.num_layers)
        ]

    def score(
        self,
        input_ids: torch.Tensor,
        kv_codec: str = "auto",
        block_size: Optional[int] = None,
        chunk_size: Optional[int] = None,
    ) -> torch.Tensor:
        """Logits (L, vocab) for one sequence run through the paged path (eval, tests).

        ``chunk_size`` splits the prompt into chunks (chunked prefill) — the result is the same.
        ``block_size`` None: the engine's default for the codec (:func:`bytediet.kvcache.base.default_block_size`).
        """
        block_size = block_size or default_block_size(kv_codec)
        ids = input_ids.reshape(-1).to(self.device)
        length = ids.shape[0]
        caches = self.new_caches(math.ceil(length / block_size), block_size, kv_codec)
        chunk = chunk_size or length
        outs = []
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            meta = _chunk_metadata(start, end, length, block_size, self.device)
            outs.append(self.forward(ids[start:end], meta, caches))
        return torch.cat(outs)

    @torch.inference_mode()
    def score_rows(
        self,
        input_ids: torch.Tensor,
        start: int,
        stop: int,
        rows: int,
        kv_codec: str = "auto",
        block_size: Optional[int] = None,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """:meth:`score`'s logits of positions start..stop-1 in near-equal chunks of at most ``rows`` positions
        (at least ``rows`` when the span allows): the decoder runs once, ``lm_head`` once per chunk, so no more
        than a chunk of (rows, vocab) logits exists at a time. Yields (first position, (n, vocab) float32)."""
        block_size = block_size or default_block_size(kv_codec)
        ids = input_ids.reshape(-1).to(self.device)
        length = ids.shape[0]
        caches = self.new_caches(math.ceil(length / block_size), block_size, kv_codec)
        meta = _chunk_metadata(0, length, length, block_size, self.device)
        x = self.embed(ids)
        for layer, cache in zip(self.model.layers, caches):
            x = layer(x, meta, cache)
        chunks = max(1, (stop - start) // max(rows, 1))
        for part in torch.arange(start, stop).tensor_split(chunks):
            lo, hi = int(part[0]), int(part[-1]) + 1
            yield lo, self.head(x[lo:hi])


def _chunk_metadata(start: int, end: int, total: int, block_size: int, device) -> AttentionMetadata:
    """Metadata for tokens [start, end) of one sequence stored in blocks 0..ceil(total/bs)-1."""
    full = AttentionMetadata.for_single_sequence(total, block_size, device)
    n = end - start
    return AttentionMetadata(
        positions=full.positions[start:end],
        slot_mapping=full.slot_mapping[start:end],
        query_start_loc=torch.tensor([0, n], device=device),
        context_lens=torch.tensor([end], device=device),
        block_tables=full.block_tables,
        block_size=block_size,
        query_lens_list=[n],
        context_lens_list=[end],
        seq_ids=[0],
    )
