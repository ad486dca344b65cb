"""Which slice of every sharded dimension one tensor-parallel rank holds (Megatron-LM's partitioning).

Shoeybi et al. 2019, arXiv 1909.08053: attention is split by heads and the MLP by its intermediate
dimension, so each block needs one all-reduce after its row-parallel output projection; the vocabulary
is split for the embedding and the output layer.

Grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245) constrains the head split: a rank must
hold the KV heads its query heads read. With at least as many KV heads as ranks, the KV heads are
dealt out in contiguous runs as evenly as possible (SmolLM2's 3 over 2 ranks: 2 + 1) and every rank
takes the query heads of its KV groups. With fewer KV heads than ranks (Gemma-3-270M: 1), each KV head
is replicated on ``world / num_kv_heads`` ranks, which split its group of query heads among them.
Sizes may differ by one unit between ranks; all-reduces sum full-width tensors and the logits gather
pads, so uneven splits cost nothing in correctness.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..errors import ConfigError


def even_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``n`` items are cut into ``parts`` contiguous runs whose
    sizes differ by at most one (the first ``n % parts`` runs get the extra item)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


@dataclass(frozen=True)
class Partition:
    """One rank's slices. Ranges are ``(start, stop)`` in units of heads, channels or tokens."""

    rank: int
    world: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def partition(config: ModelConfig, rank: int, world: int) -> Partition:
    """The slices rank ``rank`` of ``world`` holds for a model of ``config``; raises if it cannot be split."""
    if not 0 <= rank < world:
        raise ConfigError(f"tensor-parallel rank {rank} is outside [0, {world})")
    nkv, group = config.num_kv_heads, config.num_heads // config.num_kv_heads
    if nkv >= world:
        kv = even_range(nkv, world, rank)
        q = (kv[0] * group, kv[1] * group)
    else:
        if world % nkv:
            raise ConfigError(
                f"tensor-parallel size {world}: the model has {nkv} KV heads; with fewer KV heads than ranks the "
                f"size must be a multiple of {nkv} (each KV head is replicated on the same number of ranks)"
            )
        share = world // nkv  # ranks per KV head
        if share > group:
            raise ConfigError(
                f"tensor-parallel size {world} exceeds the model's {config.num_heads} query heads; use at most "
                f"{nkv * group} ranks"
            )
        head = rank // share
        lo, hi = even_range(group, share, rank % share)
        kv, q = (head, head + 1), (head * group + lo, head * group + hi)
    return Partition(
        rank,
        world,
        q,
        kv,
        even_range(config.intermediate_size, world, rank),
        even_range(config.vocab_size, world, rank),
    )
