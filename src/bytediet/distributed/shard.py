"""Cut a model into one rank's shard while it loads, and wire the shard's collectives (Megatron-LM).

Shoeybi et al. 2019, arXiv 1909.08053, section 3: q/k/v and gate/up are *column-parallel* (each rank
keeps the output rows of its heads / intermediate channels), o and down are *row-parallel* (the
matching input columns; the partial products are summed by one all-reduce each), the embedding and
``lm_head`` are split by vocabulary (a masked lookup + all-reduce; the logits all-gathered).

:class:`Sharder` is the loader's per-tensor hook (:func:`bytediet.models.loader.load_model`'s
``shard``): every tensor is cut to this rank's slice as soon as it is installed, in the layer's own
weight format (:meth:`bytediet.quant.base.WeightFormat.shard`), so a rank never holds more than its
shard plus the one tensor being converted. :func:`install` then sets the local head counts and adds
the collectives as forward hooks (the layout of gpt-fast's ``tp.py``), leaving the model's modules,
names and forward pass as they are.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from ..models.layers import Linear
from ..models.transformer import CausalLM
from .comm import TPGroup
from .partition import Partition, partition

COLUMN, ROW, VOCAB = "column", "row", "vocab"  # output rows cut / input columns cut / embedding rows cut


def _plan(name: str) -> Optional[tuple[str, str]]:
    """(kind of split, partition field) for a module name (by its last part); None: replicated (norms)."""
    leaf = name.rsplit(".", 1)[-1]
    return {
        "q_proj": (COLUMN, "q_heads"),
        "k_proj": (COLUMN, "kv_heads"),
        "v_proj": (COLUMN, "kv_heads"),
        "gate_proj": (COLUMN, "intermediate"),
        "up_proj": (COLUMN, "intermediate"),
        "o_proj": (ROW, "q_heads"),
        "down_proj": (ROW, "intermediate"),
        "lm_head": (COLUMN, "vocab"),
        "embed_tokens": (VOCAB, "vocab"),
    }.get(leaf)


class Sharder:
    """The loader hook: ``sharder(module_name, module, kind)`` after each tensor is installed."""

    def __init__(self, part: Partition, head_dim: int) -> None:
        self.part, self.head_dim = part, head_dim
        self._embedding: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (full table, its shard)

    def rows(self, field: str) -> tuple[int, int]:
        """The weight rows (or columns) of a partition range: heads count ``head_dim`` rows each."""
        lo, hi = getattr(self.part, field)
        unit = self.head_dim if field.endswith("heads") else 1
        return lo * unit, hi * unit

    def __call__(self, name: str, module: nn.Module, kind: str) -> None:
        plan = _plan(name)
        if plan is None or self.part.world == 1:
            return
        split, field = plan
        lo, hi = self.rows(field)
        if split == VOCAB:
            full = module.weight.data
            module.weight = nn.Parameter(full[lo:hi].contiguous(), requires_grad=False)
            self._embedding = (full, module.weight.data)
        elif kind == "bias":
            if split == COLUMN:
                module.bias = nn.Parameter(module.bias.data[lo:hi].contiguous(), requires_grad=False)
            elif self.part.rank != 0:  # a row-parallel bias is added once, after the sum
                module.bias = nn.Parameter(torch.zeros_like(module.bias), requires_grad=False)
        else:
            self._shard_linear(module, split, lo, hi)

    def _shard_linear(self, lin: Linear, split: str, lo: int, hi: int) -> None:
        packed = lin.packed
        if self._embedding is not None and _same_tensor(packed.get("weight"), self._embedding[0]):
            packed = {"weight": self._embedding[1]}  # tied lm_head: share the embedding's shard
        else:
            packed = lin.format.shard(packed, 0 if split == COLUMN else 1, lo, hi)
        lin.set_packed(lin.format, packed)
        if split == COLUMN:
            lin.out_features = hi - lo
        else:
            lin.in_features = hi - lo


def _same_tensor(a: Optional[torch.Tensor], b: torch.Tensor) -> bool:
    return a is not None and a.data_ptr() == b.data_ptr() and a.shape == b.shape


class VocabParallelEmbedding(nn.Module):
    """The embedding rows ``[lo, hi)`` of the vocabulary; other ids look up zeros, and the ranks' sum is
    the full lookup (exactly: one term per token is non-zero)."""

    def __init__(self, weight: torch.Tensor, vocab: tuple[int, int], group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab, self.group = vocab, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        lo, hi = self.vocab
        mine = (input_ids >= lo) & (input_ids < hi)  # (T,)
        x = F.embedding(torch.where(mine, input_ids - lo, 0), self.weight)  # (T, hidden)
        return self.group.all_reduce(x.masked_fill(~mine[..., None], 0))


def install(model: CausalLM, group: TPGroup) -> CausalLM:
    """Turn a model whose tensors :class:`Sharder` cut into a working shard: local head counts, the two
    all-reduces per layer, the vocabulary-parallel embedding and the logits' all-gather."""
    full = model.config
    part = partition(full, group.rank, group.world)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.num_heads, attn.num_kv_heads = part.num_heads, part.num_kv_heads
        attn.o_proj.register_forward_hook(lambda _m, _x, y: group.all_reduce(y))
        layer.mlp.down_proj.register_forward_hook(lambda _m, _x, y: group.all_reduce(y))
    table = model.model.embed_tokens.weight.data
    model.model.embed_tokens = VocabParallelEmbedding(table, part.vocab, group)
    sizes = [hi - lo for lo, hi in (partition(full, r, group.world).vocab for r in range(group.world))]
    model.lm_head.register_forward_hook(lambda _m, _x, y: group.all_gather_last(y, sizes))
    # the rank's own shapes (its KV cache holds only its heads); the vocabulary stays whole
    model.config = replace(
        full,
        num_heads=part.num_heads,
        num_kv_heads=part.num_kv_heads,
        intermediate_size=part.intermediate[1] - part.intermediate[0],
    )
    model.full_config = full
    model.tensor_parallel, model.kv_head_range = (group.rank, group.world), part.kv_heads
    model.tp_group = group  # for functions rank 0 runs on every shard (a link measurement)
    return model


def full_shape(name: str, shape: tuple[int, int], config: ModelConfig) -> tuple[int, int]:
    """The ``(out, in)`` features linear layer ``name`` has in the whole model (``config``: the full one), from
    one rank's ``shape`` of it: the split dimension is the partition field's whole extent."""
    plan = _plan(name)
    if plan is None:
        return shape
    split, field = plan
    whole = {
        "q_heads": config.num_heads * config.head_dim,
        "kv_heads": config.num_kv_heads * config.head_dim,
        "intermediate": config.intermediate_size,
        "vocab": config.vocab_size,
    }[field]
    return (whole, shape[1]) if split == COLUMN else (shape[0], whole)


def load_shard(group: TPGroup, spec: str, load_tokenizer: bool = False, **load_args):
    """``(model shard, tokenizer)`` of rank ``group.rank``: :func:`load_model` reading only this rank's slices,
    then :func:`install`. ``load_args``: ``dtype``, ``weights``, ``keep_packed``, ``activations``."""
    from ..models.loader import load_config, load_model

    config = load_config(spec)
    sharder = Sharder(partition(config, group.rank, group.world), config.head_dim)
    model, tokenizer = load_model(spec, load_tokenizer=load_tokenizer, shard=sharder, **load_args)
    return install(model, group), tokenizer
