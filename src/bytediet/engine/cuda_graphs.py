"""CUDA graphs for decode steps, as nano-vllm captures them (``nanovllm/engine/model_runner.py``).

One graph per batch-size bucket (1, 2, 4, 8, then every 16 up to the engine's most sequences), captured largest
first so the smaller ones fit in the memory pool the first one made (one pool for all). Each graph reads static
input buffers: a step of n sequences is copied into the first n rows of its bucket's buffers, the other rows point
at a padding block outside the block manager's pool (position 0, one token of context), and the graph replays the
whole forward pass — every linear, the paged attention, the LM head — with no launch overhead and no host
synchronisation. Prefill steps and batches larger than the largest bucket run eagerly.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kvcache.base import AttentionMetadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, then every 16, up to the first that holds ``max_num_seqs`` sequences."""
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return sizes[: next(i + 1 for i, b in enumerate(sizes) if b >= max_num_seqs)]


def bucket_for(n: int, sizes: list[int]) -> Optional[int]:
    """The smallest bucket that holds ``n`` sequences, or None (more than the largest: run eagerly)."""
    return next((b for b in sorted(sizes) if b >= n), None)


def pad_decode_batch(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    size: int,
    width: int,
    pad_block: int,
    block_size: int,
) -> tuple[torch.Tensor, ...]:
    """One decode step of n sequences as ``size`` rows (n ≤ size): the real rows first, then padding rows that
    read and write only ``pad_block`` (its first slot, position 0, one token of context).

    Returns (input_ids, positions, slot_mapping, context_lens (size,), block_tables (size, width)) on the inputs'
    device; the real tables are widened to ``width`` columns with −1."""
    n = input_ids.shape[0]
    dev = input_ids.device
    ids = torch.zeros(size, dtype=torch.int64, device=dev)
    pos = torch.zeros(size, dtype=torch.int64, device=dev)
    slot = torch.full((size,), pad_block * block_size, dtype=torch.int64, device=dev)
    ctx = torch.ones(size, dtype=torch.int64, device=dev)
    tables = torch.full((size, width), -1, dtype=torch.int64, device=dev)
    tables[n:, 0] = pad_block
    ids[:n], pos[:n], slot[:n], ctx[:n] = input_ids, positions, slots, context_lens
    tables[:n, : block_tables.shape[1]] = block_tables
    return ids, pos, slot, ctx, tables


class DecodeGraphs:
    """The captured decode graphs of one model over one set of KV pages (nano-vllm's ``capture_cudagraph``)."""

    def __init__(self, model, caches, max_num_seqs: int, width: int, pad_block: int, block_size: int) -> None:
        self.model, self.caches = model, caches
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.width, self.pad_block, self.block_size = width, pad_block, block_size
        b, dev = self.sizes[-1], model.device
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        padded = pad_decode_batch(empty, empty, empty, empty, empty.view(0, 0), b, width, pad_block, block_size)
        self.ids, self.positions, self.slots, self.context_lens, self.tables = padded
        self.rows = torch.arange(b, dtype=torch.int64, device=dev)  # token i is sequence i; logits of every row
        self.starts = torch.arange(b + 1, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            self.positions[:size],
            self.slots[:size],
            self.starts[: size + 1],
            self.context_lens[:size],
            self.tables[:size],
            self.block_size,
            [1] * size,
            [self.width * self.block_size] * size,
        )
        meta.__dict__["token_rows"] = self.rows[:size]  # the cached property, as a static buffer (no host copy)
        return meta

    def forward(self, size: int) -> torch.Tensor:
        """The forward pass a graph captures: the first ``size`` rows of the static buffers → logits (size, vocab)."""
        return self.model(self.ids[:size], self._meta(size), self.caches, self.rows[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, the largest first, all in one memory pool."""
        pool = None
        for size in reversed(self.sizes):
            self.forward(size)  # warm up: compile the kernels, settle the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self.forward(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def fits(self, meta: AttentionMetadata, logit_rows: torch.Tensor) -> bool:
        """Whether a step is a decode step a graph replays: one token per sequence, every one sampled."""
        n = len(meta.query_lens_list)
        return (
            all(q == 1 for q in meta.query_lens_list)
            and bucket_for(n, self.sizes) is not None
            and logit_rows.shape[0] == n
            and meta.block_tables.shape[1] <= self.width
        )

    def fill(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> int:
        """Copy a decode step of n sequences into the static buffers (padded); returns its bucket."""
        size = bucket_for(input_ids.shape[0], self.sizes)
        padded = pad_decode_batch(
            input_ids,
            meta.positions,
            meta.slot_mapping,
            meta.context_lens,
            meta.block_tables,
            size,
            self.width,
            self.pad_block,
            self.block_size,
        )
        for buf, value in zip((self.ids, self.positions, self.slots, self.context_lens, self.tables), padded):
            buf[:size].copy_(value)
        return size

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits (n, vocab) of a decode step of n sequences, by replaying its bucket's graph."""
        size = self.fill(input_ids, meta)
        self.graphs[size].replay()
        return self.logits[size][: input_ids.shape[0]].clone()
