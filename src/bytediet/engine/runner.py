"""The model runner turns a scheduled batch into tensors, runs one forward pass and returns logits.

It owns the model and the per-layer KV pages; it makes no scheduling decision.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch

from ..kernels import backend, ops
from ..kvcache.base import AttentionMetadata, KVCodec
from ..kvcache.config import CacheConfig
from ..models.native_decode import native_decoder, why_not_native
from ..models.transformer import CausalLM
from .cuda_graphs import DecodeGraphs
from .device import check_kernels
from .device import describe as describe_device
from .scheduler import SchedulerOutput


def num_blocks_for_budget(codec: KVCodec, model: CausalLM, cache: CacheConfig) -> int:
    """How many blocks fit in ``cache.kv_cache_memory`` with this codec (all layers together)."""
    c = model.config
    per_block = codec.bytes_per_token(c.num_kv_heads, c.head_dim) * c.num_layers * cache.block_size
    return max(1, int(cache.kv_cache_memory // per_block))


def sequence_limit(caches) -> Optional[int]:
    """The fewest sequences any layer's per-sequence state holds at once (KIVI's and the fp16 window's staging
    pools), or None when no layer limits them beyond the blocks."""
    limits = [n for n in (cache.max_sequences() for cache in caches) if n is not None]
    return min(limits) if limits else None


def sequence_capacity(codec: KVCodec, model: CausalLM, cache: CacheConfig, seq_len: int) -> dict:
    """How many ``seq_len``-token sequences the engine runs at once in ``cache.kv_cache_memory`` with ``codec``.

    The engine's own sizing: the block pool of :func:`num_blocks_for_budget` (all-in bytes per token, staging
    pools amortised) divided into whole blocks per sequence, capped by the layers' per-sequence state
    (:func:`sequence_limit`, which the engine also enforces). The pages are created on the ``meta`` device, so
    nothing is allocated. Returns ``{"sequences", "num_blocks", "by_blocks", "by_staging"}`` (``by_staging``
    None: no per-sequence limit)."""
    c = model.config
    num_blocks = cache.num_blocks or num_blocks_for_budget(codec, model, cache)
    by_blocks = num_blocks // -(-seq_len // cache.block_size)
    caches = [
        codec.create_cache(i, num_blocks, cache.block_size, c.num_kv_heads, c.head_dim, model.dtype, "meta")
        for i in range(c.num_layers)
    ]
    by_staging = sequence_limit(caches)
    sequences = by_blocks if by_staging is None else min(by_blocks, by_staging)
    return {"sequences": sequences, "num_blocks": num_blocks, "by_blocks": by_blocks, "by_staging": by_staging}


class ModelRunner:
    """Turns a scheduled batch into tensors and logits; owns the model, the KV pages and the thread policy.

    ``num_threads``: the native kernels' pool when the native decode step runs (default: torch's threads).
    ``cuda_graphs``: the most sequences a captured decode graph holds (0: none; the engine asks for them on
    CUDA unless ``enforce_eager``).
    """

    def __init__(
        self,
        model: CausalLM,
        cache: CacheConfig,
        workers=None,
        num_threads: Optional[int] = None,
        *,
        cuda_graphs: int = 0,
    ) -> None:
        self.model = model
        self.block_size = cache.block_size
        self.codec = cache.build_codec(model.dtype, getattr(model, "rope", None))  # built once, from name + state
        self.num_blocks = cache.num_blocks or num_blocks_for_budget(self.codec, model, cache)
        triton = backend.triton_selected(torch.empty(0, device=model.device))
        # a decode graph's padding rows read and write one block past the block manager's pool
        self.caches = model.new_caches(self.num_blocks + (1 if cuda_graphs else 0), self.block_size, self.codec)
        c = model.config
        self.bytes_per_token = self.codec.bytes_per_token(c.num_kv_heads, c.head_dim) * c.num_layers
        self.max_sequences = sequence_limit(self.caches)  # the codec's per-sequence state (KIVI's staging)
        if triton:  # the GPU path: every linear and attention by the Triton kernels, refused at start if one lacks
            check_kernels(model, self.caches, self.codec.name)
        self.decoder = None if triton else native_decoder(model, self.caches)  # None: the module path runs
        self.prefill_threads = 1  # torch threads for steps with prefill chunks (set by each step_threads)
        if self.decoder is not None:  # the kernel pool gets the threads; torch gets one inside each step
            ops.native_library().set_num_threads(num_threads or torch.get_num_threads())
        self.decode_path = (
            "native"
            if self.decoder is not None
            else "triton"
            if triton
            else f"modules ({why_not_native(model, self.caches)})"
        )
        self.graphs = None
        if cuda_graphs and self.max_sequences is None:
            self._capture(cuda_graphs)
        elif cuda_graphs:  # per-sequence KV state (KIVI's staging pages) moves outside any graph
            self.decode_path += ", eager (the KV codec keeps per-sequence state)"
        if triton and workers is not None:  # the GPU path's steps across ranks: no decode graphs
            self.decode_path += f", tensor parallel over {workers.world} ranks, eager"
        # tensor parallel (bytediet.distributed.launch.Workers): ranks 1..N-1 mirror each forward on their shards
        self.workers = workers
        if workers is not None:
            workers.allocate(self.codec, self.num_blocks, self.block_size)

    def _capture(self, max_num_seqs: int) -> None:
        """Capture the decode graphs (:mod:`bytediet.engine.cuda_graphs`); a capture that fails leaves the steps
        eager and says why in ``decode_path`` (reported by ``generate --json`` and ``bench``)."""
        width = min(self.num_blocks, -(-self.model.config.max_position_embeddings // self.block_size))
        try:
            graphs = DecodeGraphs(self.model, self.caches, max_num_seqs, width, self.num_blocks, self.block_size)
            graphs.capture()
        except Exception as e:
            self.decode_path += f", eager (CUDA graph capture failed: {type(e).__name__}: {str(e).splitlines()[0]})"
            return
        self.graphs = graphs
        self.decode_path += f", CUDA graphs for batch {','.join(map(str, graphs.sizes))}"

    def describe(self) -> dict:
        """What runs on which device: the backend, each weight layout's kernel, the attention's, the decode step."""
        return describe_device(self.model, self.caches, self.decode_path)

    def kv_cache_bytes(self) -> int:
        return sum(cache.nbytes() for cache in self.caches)

    def free_sequence(self, seq_id: int) -> None:
        for cache in self.caches:
            cache.free_sequence(seq_id)
        if self.workers is not None:
            self.workers.free_sequence(seq_id)

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the batch: input ids (T,), metadata, and the rows whose logits are needed (N,).

        The rows: one per request that samples (1 + its drafts for one that verifies speculative drafts), in
        schedule order, then each request's ``prompt_logprob_positions`` (schedule order, ascending positions).
        """
        bs = self.block_size
        ids, positions, slots, qlens, clens, logit_rows, tables, seq_ids = [], [], [], [], [], [], [], []
        prompt_rows = []
        row = 0
        for s in out.scheduled:
            prompt_rows.extend(row + p - s.request.num_computed_tokens for p in s.prompt_logprob_positions)
            req, start, n = s.request, s.request.num_computed_tokens, s.num_tokens
            ids.extend(req.all_token_ids[start : start + n - len(s.drafts)] + s.drafts)
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(req.block_ids[p // bs] * bs + p % bs for p in pos)
            qlens.append(n)
            clens.append(start + n)
            tables.append(req.block_ids)
            seq_ids.append(req.seq_id)
            row += n
            if s.samples:
                logit_rows.extend(range(row - 1 - len(s.drafts), row))
        logit_rows += prompt_rows
        width = max(len(t) for t in tables)
        block_tables = torch.full((len(tables), width), -1, dtype=torch.int64)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
        qsl = torch.zeros(len(qlens) + 1, dtype=torch.int64)
        qsl[1:] = torch.cumsum(torch.tensor(qlens, dtype=torch.int64), 0)
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=qsl,
            context_lens=torch.tensor(clens, dtype=torch.int64),
            block_tables=block_tables,
            block_size=bs,
            query_lens_list=qlens,
            context_lens_list=clens,
            seq_ids=seq_ids,
        )
        device = self.model.device
        return (
            torch.tensor(ids, dtype=torch.int64, device=device),
            meta.to(device),
            torch.tensor(logit_rows, dtype=torch.int64, device=device),
        )

    @contextmanager
    def step_threads(self):
        """The threads of one engine step (schedule, run, sample): with the native decode step, torch keeps one
        thread (its OpenMP workers would spin on the cores the kernel pool needs) and :meth:`run` gives it back its
        threads for steps with prefill chunks, whose attention and large float GEMMs are torch's."""
        if self.decoder is None:
            yield
            return
        self.prefill_threads = torch.get_num_threads()
        with torch_threads(1):
            yield

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits (N, vocab) float32 of the rows :meth:`prepare` picks: the sampling requests', then prompt rows."""
        input_ids, meta, logit_rows = self.prepare(out)
        if self.graphs is not None and self.workers is None and self.graphs.fits(meta, logit_rows):
            return self.graphs.run(input_ids, meta)
        if self.decoder is not None and native_step_takes(out, len(input_ids)) and self.decoder.ready():
            token_rows = None
            if len(input_ids) > len(meta.query_lens_list):  # drafts, chunks: a sequence's rows share its table row
                lens = torch.tensor(meta.query_lens_list, dtype=torch.int64)
                token_rows = torch.repeat_interleave(torch.arange(len(lens)), lens)
            return self.decoder.logits(input_ids, meta, logit_rows, token_rows)
        if self.decoder is not None and self.workers is None and self.prefill_threads > torch.get_num_threads():
            with torch_threads(self.prefill_threads):  # step_threads lowered them for the native decode step
                return self.model(input_ids, meta, self.caches, logit_rows)
        if self.workers is not None:
            return self.workers.run(
                input_ids, meta, logit_rows, lambda: self.model(input_ids, meta, self.caches, logit_rows)
            )
        return self.model(input_ids, meta, self.caches, logit_rows)  # (0, vocab) when nobody samples


# the most tokens a step with prefill chunks may carry for the one-call native step to run it (a pure decode step
# always goes native): below it the module path's ~30 torch ops a layer cost more than they save; above it the
# module path's float GEMM of decoded weights (CPUs without the panel GEMM) beat the step's x4 products — measured
# on Zen 2 AVX2 after a 2k cached prefix, SmolLM2 / Gemma-3 at 64 tokens 316 / 280 ms against 483 / 310 ms, at 128
# 630 / 570 against 770 / 465 ms (bench/RESULTS.md, Recording 24)
NATIVE_PREFILL_MAX_TOKENS = 64


def native_step_takes(out: SchedulerOutput, num_tokens: int) -> bool:
    """Whether the one-call native step runs this step: every scheduled request's tokens are consecutive positions
    from its computed count — its last token and drafts, or a prefill chunk — whose query rows attend causally over
    the pages the step writes first; a step with prefill chunks only up to NATIVE_PREFILL_MAX_TOKENS tokens."""
    return num_tokens <= NATIVE_PREFILL_MAX_TOKENS or all(
        s.request.num_computed_tokens + 1 == s.request.num_tokens and s.num_tokens == 1 + len(s.drafts)
        for s in out.scheduled
    )


def set_threads(num_threads: Optional[int]) -> None:
    """The process's torch threads, where the user names a count (``LLM(num_threads=…)``); None keeps torch's."""
    if num_threads:
        torch.set_num_threads(num_threads)


@contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` inside the block, restored after it (scoped to a step, so code after
    the engine keeps its threads; why the step lowers them: :meth:`ModelRunner.step_threads`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
