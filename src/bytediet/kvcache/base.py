"""The KV-cache extension point: a codec owns its page layout, its size and its attention read.

Data flow for one attention layer in one engine step (vLLM-style paged attention):

1. the engine's runner builds one :class:`AttentionMetadata` for the ragged batch;
2. the layer computes ``q, k, v`` for the new tokens and calls
   ``cache.write(k, v, meta.slot_mapping, meta.positions)``;
3. it then calls ``cache.attend(q, meta, scale, window)``, which reads *every* context token,
   the new ones included, back from the (possibly compressed) pages.

Because step 3 reads the pages, a lossy codec affects prefill as well as decode, which is what
makes perplexity a faithful measure of a codec.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import torch

from ..errors import ConfigError
from ..kernels import backend, ops
from ..kernels.types import KVPage, PageKind
from ..registry import Registry


@dataclass
class AttentionMetadata:
    """Explicit description of a ragged batch for paged attention.

    T = total new tokens in the step, S = number of sequences in the step.

    positions:        (T,) int64, absolute position of each new token in its sequence
    slot_mapping:     (T,) int64, cache slot of each new token (``block * block_size + offset``)
    query_start_loc:  (S+1,) int64, cumulative new-token counts; sequence s owns rows
                      ``query_start_loc[s]:query_start_loc[s+1]`` of q
    context_lens:     (S,) int64, tokens in the cache for each sequence *after* this step's write
    block_tables:     (S, max_blocks) int64, physical block ids in logical order, padded with -1
    block_size:       tokens per block
    query_lens_list / context_lens_list: the same numbers as Python ints (no device sync in loops)
    seq_ids:          (S,) int engine ids of the sequences, for codecs that keep per-sequence state
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    query_lens_list: list[int]
    context_lens_list: list[int]
    seq_ids: Optional[list[int]] = None

    @cached_property
    def token_rows(self) -> torch.Tensor:
        """(T,) int64: the sequence (block table row) of each new token, built once per step."""
        lens = torch.tensor(self.query_lens_list, dtype=torch.int64, device=self.positions.device)
        return torch.repeat_interleave(torch.arange(len(self.query_lens_list), device=self.positions.device), lens)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def to(self, device: torch.device | str) -> "AttentionMetadata":
        move = lambda t: t.to(device)
        return AttentionMetadata(
            move(self.positions),
            move(self.slot_mapping),
            move(self.query_start_loc),
            move(self.context_lens),
            move(self.block_tables),
            self.block_size,
            self.query_lens_list,
            self.context_lens_list,
            self.seq_ids,
        )

    @staticmethod
    def for_single_sequence(
        num_tokens: int, block_size: int, device: torch.device | str = "cpu", first_block: int = 0
    ) -> "AttentionMetadata":
        """Metadata for one fresh sequence of ``num_tokens`` in consecutive blocks (eval, tests)."""
        n_blocks = math.ceil(num_tokens / block_size)
        blocks = torch.arange(first_block, first_block + n_blocks, dtype=torch.int64, device=device)
        positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
        return AttentionMetadata(
            positions=positions,
            slot_mapping=positions + first_block * block_size,
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int64, device=device),
            context_lens=torch.tensor([num_tokens], dtype=torch.int64, device=device),
            block_tables=blocks[None, :],
            block_size=block_size,
            query_lens_list=[num_tokens],
            context_lens_list=[num_tokens],
            seq_ids=[0],
        )


STEP_PAGE_KINDS = (PageKind.ROW, PageKind.BLOCK, PageKind.TURBOQUANT)  # what the decode step reads and writes


@dataclass(frozen=True)
class StepPages:
    """What the one-call native decode step (``ops.decode_step``) reads and writes of one layer's cache: its pages
    as ``LayerSpec`` fields (``k_dtype``, ``k_cache`` …), or ``objection``, one line saying why it cannot."""

    fields: Optional[dict] = None
    objection: str = ""


class LayerKVCache(ABC):
    """The KV pages of one attention layer, in the layout its codec chose."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @abstractmethod
    def write(
        self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, positions: Optional[torch.Tensor] = None
    ) -> None:
        """Store new keys and values. k, v: (T, num_kv_heads, head_dim); slot_mapping, positions: (T,).

        ``positions`` (each token's position in its sequence) matters only to codecs whose stored form
        depends on it (TurboQuant's pre-RoPE key mean); the others ignore it."""

    @abstractmethod
    def attend(
        self, q: torch.Tensor, meta: AttentionMetadata, scale: float, window: Optional[int] = None
    ) -> torch.Tensor:
        """Causal attention of the new queries over each sequence's cached context.

        q: (T, num_heads, head_dim) → output (T, num_heads, head_dim) in q's dtype.
        ``window``: if set, a query at position p sees keys at positions > p - window only.
        """

    def native_pages(self) -> Optional[dict]:
        """The pages as the native attention reads them in place — ``k_dtype`` (one of
        ``kernels.decoder_spec.ATTENTION_PAGE_TYPES``; the keys', and the values' unless ``v_dtype`` names
        another), ``k_cache``/``v_cache`` (slots, H, D), or (slots, H, D/32 · block bytes) for the GGML block types,
        and for int8/fp8 ``k_scale``/``v_scale`` (slots, H, 1) float16, and for code pages (KIVI's; one of
        ``kernels.decoder_spec.CODE_PAGE_TYPES``) ``k_side``/``v_side`` (``CodePageSide``: scales, zero points,
        staging pages) — or None for pages only the codec's own read understands."""
        return None

    def step_pages(self) -> StepPages:
        """The pages as the native decode step reads and writes them, or why it cannot: by default
        :meth:`native_pages` when they are row or block pages (``types.PageKind``); codecs answer for themselves."""
        pages = self.native_pages()
        kinds = f"{type(self).__name__} ({getattr(getattr(self, 'k', None), 'dtype', '?')})"
        if pages is None:
            return StepPages(objection=f"KV cache {kinds} has no native step (its pages have no native read)")
        if any(
            KVPage.named(pages.get(side) or pages["k_dtype"]).kind not in STEP_PAGE_KINDS
            for side in ("k_dtype", "v_dtype")
        ):
            return StepPages(objection=f"KV cache {kinds}: {pages['k_dtype']} pages have no native step")
        return StepPages({k: v for k, v in pages.items() if k not in ("k_side", "v_side")})

    def step_ready(self) -> bool:
        """Whether the native decode step may run on these pages now (False while the first write has still to choose
        part of their layout: TurboQuant's outlier channels)."""
        return True

    def attention_pages(self) -> Optional[dict]:
        """The pages the native *attention* reads (``native_pages``'s fields): :meth:`native_pages` unless the pages
        are stored in a basis the fused decode step does not know (rotated K/V, :mod:`bytediet.kvcache.rotated`);
        then only :meth:`attend_natively`, which rotates the query and the output around the kernel, reads them."""
        return self.native_pages()

    def attend_natively(
        self, q: torch.Tensor, meta: AttentionMetadata, scale: float, window: Optional[int]
    ) -> Optional[torch.Tensor]:
        """Attention of a step's queries — decodes, prefill chunks, or both — by the native kernel over the pages in
        place (no gather: a prefill chunk's tokens share each page row read, 8 at a time), or None where it does
        not apply: no native kernels, pages it cannot read, a non-float32 query, a query that needs gradients.
        Prefill chunks take it too: faster than the codec's gather + SDPA (bench/RESULTS.md, Recording 9)."""
        if torch.is_grad_enabled() and q.requires_grad:
            return None  # autograd (recovery training) needs the codec's differentiable read
        pages = self.attention_pages()
        if pages is not None and backend.triton_selected(q):  # the GPU path: kernels/backend.py
            return backend.attention_over_pages(
                q, meta.positions, meta.token_rows, meta.block_tables, meta.block_size, scale, window, **pages
            )
        if q.dtype != torch.float32 or self.head_dim % 8 or pages is None or ops.native_library() is None:
            return None
        return ops.attention_over_pages(
            q, meta.positions, meta.token_rows, meta.block_tables, meta.block_size, scale, window, **pages
        )

    def free_sequence(self, seq_id: int) -> None:  # noqa: B027 - optional hook
        """Forget per-sequence state (codecs that keep some); called when a request's blocks are freed."""

    def max_sequences(self) -> Optional[int]:
        """How many sequences may hold per-sequence state here at once (KIVI's open key groups); None: no
        limit beyond the blocks. The engine runs at most this many sequences at a time."""
        return None

    def nbytes(self) -> int:
        """Bytes actually allocated for this layer's pages."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return []


class KVCodec(ABC):
    """How the KV cache is stored. ``bytes_per_token`` sizes the block pool *and* feeds the roofline."""

    name: str = "abstract"

    @abstractmethod
    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float:
        """All-in bytes for one token's K and V in one layer (codes, scales, norms, metadata)."""

    @abstractmethod
    def create_cache(
        self,
        layer: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> LayerKVCache:
        """Allocate the pages of one layer. ``dtype`` is the model's compute dtype."""

    def min_block_size(self) -> int:
        """The smallest KV block (tokens) this codec can page; e.g. KIVI's key groups must fit in a block."""
        return 1

    def for_heads(self, lo: int, hi: int) -> "KVCodec":
        """This codec for KV heads ``[lo, hi)`` only: a tensor-parallel rank's cache holds just its heads, so
        per-head calibration state (fp8 scales, QJL / TurboQuant means) is sliced to them. Default: stateless."""
        return self

    def bits_per_coordinate(self, num_kv_heads: int, head_dim: int) -> float:
        """Average stored bits per K or V coordinate, everything included."""
        return self.bytes_per_token(num_kv_heads, head_dim) * 8 / (2 * num_kv_heads * head_dim)

    def calibration_state(self) -> Optional[dict]:
        """What calibration taught this codec, as plain data (dicts, lists, numbers, tensors); None if nothing.

        A calibrated codec travels as ``(name, state)``: :func:`build_kv_codec` rebuilds the same codec from
        them, so configs never hold codec objects (see :class:`~bytediet.kvcache.config.CacheConfig`)."""
        return None

    def load_calibration_state(self, state: dict, rope=None) -> None:
        """Restore :meth:`calibration_state`'s ``state``. ``rope(layer)``: the model's rotary embedding of a layer,
        for codecs whose state is defined before RoPE (TurboQuant's pre-RoPE key mean)."""
        if state:
            raise ConfigError(f"KV codec {self.name!r} takes no calibration state; drop kv_calibration_state")

    def describe(self, head_dim: Optional[int] = None) -> str:
        """The codec's name; given the model's ``head_dim``, codecs whose layout depends on it also say which
        layout (and which fallbacks, e.g. a QR rotation where a Hadamard needs a power of two) they use."""
        return self.name


KV_CODECS: Registry = Registry("KV-cache codec")
DEFAULT_BLOCK_SIZE = 16


def default_block_size(spec: "str | KVCodec") -> int:
    """The block size used when none is given: 16 tokens (vLLM's default), or the codec's minimum if larger."""
    return max(DEFAULT_BLOCK_SIZE, get_kv_codec(spec).min_block_size())


def get_kv_codec(spec: "str | KVCodec", model_dtype: torch.dtype = torch.float32) -> KVCodec:
    """Build a codec from a spec such as ``"bf16"``, ``"int8"``, ``"turboquant3.5"`` or ``"auto"``.

    A registered factory is called with the spec's trailing parameters (:meth:`Registry.build`); see each
    codec's module. ``k=<spec>,v=<spec>`` stores keys and values with different codecs; ``auto:<bits>`` is a
    byte budget (:mod:`bytediet.kvcache.auto`). A :class:`KVCodec`
    instance is returned as is.
    """
    if isinstance(spec, KVCodec):
        return spec
    spec = spec.strip().lower()
    if "=" in spec:  # k=<codec>,v=<codec>
        from .split import split_codec

        return split_codec(spec, lambda sub: get_kv_codec(sub, model_dtype))
    if spec.startswith("auto:"):  # a byte budget; its per-layer plan comes from calibration
        from .auto import BudgetCodec

        return BudgetCodec.from_spec(spec[len("auto") :])
    if spec in ("auto", ""):
        spec = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[model_dtype]
    return KV_CODECS.build(spec)


def build_kv_codec(spec: str, state=None, model_dtype: torch.dtype = torch.float32, rope=None) -> KVCodec:
    """The one place a configured codec becomes an object: ``spec`` (a name) plus its calibration ``state``
    (plain data, or the path of a ``torch.save``'d / JSON file of it; see :mod:`bytediet.kvcache.state`)."""
    from .state import read_state

    if not isinstance(spec, str):
        raise ConfigError(
            f"a KV codec is configured by name (and calibration state), got {type(spec).__name__}; "
            "pass codec.name and codec.calibration_state()"
        )
    codec = get_kv_codec(spec, model_dtype)
    state = read_state(state)
    if state is not None:
        codec.load_calibration_state(state, rope=rope)
    return codec


def codec_config(spec: "str | KVCodec") -> tuple[str, Optional[dict]]:
    """``(name, calibration state)``: how a codec (or a name) is written into a config; the inverse of
    :func:`build_kv_codec`."""
    if isinstance(spec, KVCodec):
        return spec.name, spec.calibration_state()
    return spec, None
