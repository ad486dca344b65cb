"""A full-precision window of each sequence's most recent tokens in front of any half codec (KIVI's residual).

Hugging Face's ``QuantizedCache`` (and KIVI, arXiv 2402.02750 §3.3) keep the newest tokens in full precision
and quantize them only when ``R`` of them have accumulated. Paged, the window is aligned to the pages: the
``R`` consecutive slots of a chunk (``R`` divides the block size, so a chunk never spans two blocks) are staged
in fp16 while the chunk is open and handed to the inner half's ``write`` in one piece when it fills. A
sequence therefore holds between 0 and R − 1 tokens in full precision.

Staging memory: one fp16 page (R × H × D) per ``period`` cache tokens, i.e. one open chunk — one running
sequence — per ``period`` tokens; the engine reads the limit (``max_sequences``) and runs no more sequences at
once. The pool and the per-chunk bookkeeping (two int32) are counted in ``bytes_per_token`` (amortised), so
the block pool and every bits-per-coordinate figure include them.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import BytedietError, ConfigError
from .halves import HalfCodec, HalfPages


class WindowPages(HalfPages):
    def __init__(self, inner: HalfPages, window: int, period: int) -> None:
        super().__init__(inner.num_slots, inner.num_heads, inner.head_dim, inner.device)
        self.inner, self.window = inner, window
        n_chunks = inner.num_slots // window
        self.fill = torch.zeros(n_chunks, dtype=torch.int32, device=inner.device)
        self.stage_of = torch.full((n_chunks,), -1, dtype=torch.int32, device=inner.device)
        n_stage = max(1, inner.num_slots // period)
        self.stage = torch.zeros(
            n_stage, window, inner.num_heads, inner.head_dim, dtype=torch.float16, device=inner.device
        )
        self.free_pages = list(range(n_stage))
        self.open_chunk: dict[int, int] = {}  # engine seq id → its open (staged) chunk

    def track_sequences(self, meta) -> None:
        """Note each sequence's last chunk (the one a later write extends); called once per attend."""
        if meta.seq_ids is None:
            return
        for s, (sid, ctx) in enumerate(zip(meta.seq_ids, meta.context_lens_list)):
            slot = (
                int(meta.block_tables[s, (ctx - 1) // meta.block_size]) * meta.block_size + (ctx - 1) % meta.block_size
            )
            c = slot // self.window
            if int(self.stage_of[c]) >= 0:
                self.open_chunk[sid] = c
            else:
                self.open_chunk.pop(sid, None)

    def max_sequences(self) -> int:
        return self.stage.shape[0]

    def free_sequence(self, seq_id: int) -> None:
        c = self.open_chunk.pop(seq_id, None)
        if c is not None:
            self._release(c)
            self.fill[c] = 0

    def _release(self, c: int) -> None:
        page = int(self.stage_of[c])
        if page >= 0:
            self.free_pages.append(page)
            self.stage_of[c] = -1

    def _flush(self, c: int, x: torch.Tensor) -> None:
        """Quantize the complete chunk ``c`` (R, H, D) into the inner pages."""
        slots = torch.arange(c * self.window, (c + 1) * self.window, device=x.device)
        self.inner.write(x.float(), slots)

    def write(self, x, slots):
        chunks, offs = slots // self.window, slots % self.window
        for c in torch.unique(chunks).tolist():
            sel = chunks == c
            xs, os = x[sel], offs[sel]
            if bool((os == 0).any()):  # the chunk starts afresh (a new sequence or a recomputation)
                self._release(c)
                self.fill[c] = 0
            self.fill[c] += len(os)
            full = int(self.fill[c]) >= self.window
            if full and int(self.stage_of[c]) < 0:  # the whole chunk in this write: no staging
                self._flush(c, xs[torch.argsort(os)])
                continue
            if int(self.stage_of[c]) < 0:
                if not self.free_pages:
                    raise BytedietError(
                        f"full-precision KV window: more than {self.stage.shape[0]} windows are open at once (one "
                        "per running sequence); give the KV cache more memory or run fewer sequences at once"
                    )
                self.stage_of[c] = self.free_pages.pop()
            page = int(self.stage_of[c])
            self.stage[page, os] = xs.to(torch.float16)
            if full:
                self._flush(c, self.stage[page])
                self._release(c)

    def decode(self, slots):
        x = self.inner.decode(slots)
        c = slots // self.window
        page = self.stage_of[c].long()
        open_ = page >= 0
        if bool(open_.any()):
            x[open_] = self.stage[page[open_], slots[open_] % self.window].float()
        return x

    def native_pages(self):
        """The inner half's code pages (``decoder_spec.CODE_PAGE_TYPES``) with this window's staging beside them: the
        native attention reads a row of an open window from its fp16 staging page, as :meth:`decode`."""
        inner = self.inner.native_pages()
        if inner is None or len(inner) < 4 or inner[3].stage_of is not None:
            return None  # row pages cannot take the staged rows
        side = dataclasses.replace(inner[3], stage_of=self.stage_of, stage=self.stage, window=self.window)
        return (*inner[:3], side)

    def tensors(self):
        return self.inner.tensors() + [self.fill, self.stage_of, self.stage]


class WindowHalf(HalfCodec):
    """``inner`` behind a full-precision window of ``window`` tokens; one staged window per ``period`` tokens."""

    def __init__(self, inner: HalfCodec, window: int, period: int = 2048) -> None:
        if window < 1 or window & (window - 1):
            raise ConfigError(f"the full-precision window must be a power of two, got {window}")
        if period < window:
            raise ConfigError(f"the staging period ({period}) must be at least the window ({window})")
        self.inner, self.window, self.period = inner, window, period
        self.name = f"{inner.name}+fp16-window{window}"

    def min_block_size(self):
        return max(self.window, self.inner.min_block_size())

    def check(self, num_heads, head_dim, block_size):
        if block_size % self.window:
            raise ConfigError(
                f"the full-precision window ({self.window} tokens) must divide the KV block size "
                f"{block_size}; use a block size of at least {self.window}"
            )
        self.inner.check(num_heads, head_dim, block_size)

    def bytes_per_token(self, num_heads, head_dim):
        stage = self.window * num_heads * head_dim * 2 / self.period  # fp16 staging, amortised
        return self.inner.bytes_per_token(num_heads, head_dim) + stage + 2 * 4 / self.window

    def create(self, layer, role, num_blocks, block_size, num_heads, head_dim, device):
        inner = self.inner.create(layer, role, num_blocks, block_size, num_heads, head_dim, device)
        return WindowPages(inner, self.window, self.period)
