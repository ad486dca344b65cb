"""A pool block's KV pages as one flat byte buffer, and back: the only code of the tiers that touches the pool.

Lossless (the default): every per-slot tensor of every layer (``LayerKVCache.tensors()``, each indexed by slot in
its first dimension) is copied for the block's slots, bit for bit, so a hit is exactly what a recompute with the pool's
codec would have written. Re-encoded (``--kv-offload-codec``): each layer's block is decoded to float and written
into a one-block cache of the smaller codec; a load decodes it and writes it back through the pool's codec.
"""

from __future__ import annotations

import json
import threading
from typing import Optional

import torch

from ...errors import ConfigError
from ..block_copy import slot_tensors

BATCH_BLOCKS = 64  # blocks moved per batch (the staging buffers hold this many)
WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)  # widest first: copying uint8 rows runs 5x slower


def _slot_tensors(cache, block_size: int, what: str) -> list[torch.Tensor]:
    tensors = slot_tensors(cache, block_size)
    if tensors is None:
        bad = [tuple(t.shape) for t in cache.tensors()]
        raise ConfigError(
            f"KV tiers: {what} keeps state outside its per-slot pages (tensor shapes {bad or 'none'}); "
            "offloading needs a codec whose pages are all indexed by slot (e.g. bf16, q8_0, turboquant)"
        )
    return tensors


class BlockPages:
    """Reads and writes one block's bytes across every layer's pages (``caches``: the runner's, one per layer)."""

    def __init__(self, caches, block_size: int, codec_name: str, at_rest=None, model_dtype=torch.float32) -> None:
        self.caches, self.block_size = caches, block_size
        self.at_rest = None
        if at_rest is None:
            self.tensors = [_slot_tensors(c, block_size, f"KV codec {codec_name!r}") for c in caches]
        else:  # one staging block of the smaller codec per layer
            for c in caches:
                if not hasattr(c, "decode"):
                    raise ConfigError(
                        f"--kv-offload-codec: the pool's codec {codec_name!r} cannot be decoded to "
                        "re-encode it; leave --kv-offload-codec out (lossless)"
                    )
            self.at_rest = [
                at_rest.create_cache(i, 1, block_size, c.num_kv_heads, c.head_dim, model_dtype, "cpu")
                for i, c in enumerate(caches)
            ]
            self.tensors = [_slot_tensors(c, block_size, f"--kv-offload-codec {at_rest.name!r}") for c in self.at_rest]
        self._parts = [
            (t.shape[1:], t.dtype, t[0].numel() * t.element_size() * block_size)
            for layer in self.tensors
            for t in layer
        ]
        self.block_bytes = sum(n for _, _, n in self._parts)
        self._flat = [t for layer in self.tensors for t in layer]  # in the order of _parts
        self._sizes = [torch.empty((), dtype=dtype).element_size() for _, dtype, _ in self._parts]
        self._words = self._word_views()
        self._staging = threading.Lock()  # the re-encoding staging blocks: one user at a time (saves and loads)
        self._buffers = {"read": threading.Lock(), "write": threading.Lock()}  # each staging buffer's user

    def layout(self) -> str:
        """The page layout as text (part of the tier key's salt)."""
        return json.dumps([[list(shape), str(dtype)] for shape, dtype, _ in self._parts])

    def _blocks(self, t: torch.Tensor) -> torch.Tensor:
        """A per-slot tensor seen as (blocks, block_size, ...)."""
        whole = t.shape[0] // self.block_size * self.block_size
        return t[:whole].view(-1, self.block_size, *t.shape[1:])

    def read(self, block_id: int, first_position: int) -> torch.Tensor:
        """The block's bytes: a new (block_bytes,) uint8 CPU tensor."""
        return self.read_many([block_id], [first_position])[0]

    def read_many(self, block_ids: list[int], first_positions: list[int]) -> list[torch.Tensor]:
        """Each block's bytes (as :meth:`read`), every layer's pages gathered once per batch of blocks."""
        if self.at_rest is not None:
            with self._staging:
                out = []
                for block_id, pos in zip(block_ids, first_positions):
                    self._encode(block_id, pos)
                    out.append(self._gather([0], self._bytes(1)).reshape(-1))
                return out
        out = []
        with self._buffers["read"]:
            for i in range(0, len(block_ids), BATCH_BLOCKS):
                ids = block_ids[i : i + BATCH_BLOCKS]
                staged = self._gather(ids, self._buffer("read", len(ids)))
                out += [row.clone() for row in staged]  # one allocation per block: the RAM tier frees them singly
        return out

    def write(self, block_id: int, data: torch.Tensor, first_position: int) -> None:
        """Put ``read``'s bytes back into the pool's block ``block_id``."""
        self.write_many([block_id], [data], [first_position])

    @torch.inference_mode()  # the pool's pages may be inference tensors, and this runs on the loader thread
    def write_many(self, block_ids: list[int], datas: list[torch.Tensor], first_positions: list[int]) -> None:
        """:meth:`write` for several blocks, every layer's pages scattered once per batch of blocks."""
        for data in datas:
            if data.numel() != self.block_bytes:
                raise ValueError(f"a block holds {self.block_bytes} bytes, got {data.numel()}")
        if self.at_rest is not None:
            with self._staging:
                for block_id, data, pos in zip(block_ids, datas, first_positions):
                    self._scatter([0], data.reshape(1, -1))
                    self._decode(block_id, pos)
            return
        with self._buffers["write"]:
            for i in range(0, len(block_ids), BATCH_BLOCKS):
                ids = block_ids[i : i + BATCH_BLOCKS]
                staged = torch.stack(datas[i : i + BATCH_BLOCKS], out=self._buffer("write", len(ids)))
                self._scatter(ids, staged)

    def _buffer(self, name: str, n: int) -> torch.Tensor:
        """The first n rows of the ``name`` (BATCH_BLOCKS, block_bytes) staging buffer, kept between calls so its
        pages are not faulted in again; the caller holds ``self._buffers[name]``."""
        attr = f"_{name}_buffer"
        if getattr(self, attr, None) is None:
            setattr(self, attr, torch.empty(BATCH_BLOCKS, self.block_bytes, dtype=torch.uint8))
        return getattr(self, attr)[:n]

    def _bytes(self, n: int) -> torch.Tensor:
        return torch.empty(n, self.block_bytes, dtype=torch.uint8)

    def _word_views(self) -> list:
        """Per part: (word dtype, the pages seen as (blocks, words per block)) where its bytes and offset allow a
        wide word and the pages are contiguous; None elsewhere (those parts are copied in their own dtype)."""
        views, offset = [], 0
        for t, (_, _, nbytes) in zip(self._flat, self._parts):
            word = next(w for w in WORDS if nbytes % w.itemsize == offset % w.itemsize == self.block_bytes % w.itemsize)
            whole = t.shape[0] // self.block_size * self.block_size
            usable = t.is_contiguous() and t.stride(-1) == 1 and t.storage_offset() == 0 and word is not torch.uint8
            views.append((word, t[:whole].view(torch.uint8).reshape(-1, nbytes).view(word)) if usable else None)
            offset += nbytes
        return views

    def _parts_of(self, data: torch.Tensor):
        """(n, block_bytes) bytes → (bytes, view) of each per-slot tensor's part: view is (n, block_size, ...) of
        its dtype, or None where the part's offset does not allow one (then it is copied)."""
        n, offset = data.shape[0], 0
        for (shape, dtype, nbytes), size in zip(self._parts, self._sizes):
            raw = data[:, offset : offset + nbytes]
            aligned = offset % size == 0 and data.stride(0) % size == 0
            yield raw, (raw.view(dtype).view(n, self.block_size, *shape) if aligned else None), (shape, dtype)
            offset += nbytes

    def _gather(self, block_ids: list[int], out: torch.Tensor) -> torch.Tensor:
        """Blocks ``block_ids`` of every per-slot tensor → their bytes in ``out`` (n, block_bytes)."""
        index = torch.tensor(block_ids, dtype=torch.int64)
        for t, words, (raw, view, _) in zip(self._flat, self._words, self._parts_of(out)):
            if words is not None and t.device.type == "cpu" and (dst := _as_words(raw, words[0])) is not None:
                torch.index_select(words[1], 0, index, out=dst)
            elif view is not None and t.device.type == "cpu":
                torch.index_select(self._blocks(t), 0, index, out=view)
            else:
                rows = self._blocks(t).index_select(0, index.to(t.device)).cpu()
                raw.copy_(rows.reshape(len(block_ids), -1).view(torch.uint8))
        return out

    def _scatter(self, block_ids: list[int], data: torch.Tensor) -> None:
        """(n, block_bytes) bytes → blocks ``block_ids`` of every per-slot tensor."""
        index = torch.tensor(block_ids, dtype=torch.int64)
        for t, words, (raw, view, (shape, dtype)) in zip(self._flat, self._words, self._parts_of(data)):
            if words is not None and (src := _as_words(raw, words[0])) is not None:
                words[1].index_copy_(0, index.to(t.device), src.to(t.device))
                continue
            if view is None:
                view = raw.contiguous().view(dtype).view(len(block_ids), self.block_size, *shape)
            self._blocks(t).index_copy_(0, index.to(t.device), view.to(t.device))

    def _positions(self, first_position: int, device) -> torch.Tensor:
        return torch.arange(first_position, first_position + self.block_size, device=device)

    def _encode(self, block_id: int, first_position: int) -> None:
        for pool, rest in zip(self.caches, self.at_rest):
            slots = torch.arange(
                block_id * self.block_size, (block_id + 1) * self.block_size, device=pool.tensors()[0].device
            )
            k, v = pool.decode(slots, self._positions(first_position, slots.device))
            rest.write(k.cpu(), v.cpu(), torch.arange(self.block_size), self._positions(first_position, "cpu"))

    def _decode(self, block_id: int, first_position: int) -> None:
        for pool, rest in zip(self.caches, self.at_rest):
            k, v = rest.decode(torch.arange(self.block_size), self._positions(first_position, "cpu"))
            device = pool.tensors()[0].device
            slots = torch.arange(block_id * self.block_size, (block_id + 1) * self.block_size, device=device)
            pool.write(k.to(device), v.to(device), slots, self._positions(first_position, device))


def _as_words(raw: torch.Tensor, word: torch.dtype) -> Optional[torch.Tensor]:
    """(n, nbytes) uint8 rows seen as (n, nbytes / word size) words, or None where their alignment forbids it."""
    size = word.itemsize
    if raw.stride(-1) != 1 or raw.stride(0) % size or raw.storage_offset() % size or raw.data_ptr() % size:
        return None
    return raw.view(word)


def offload_codec(name: Optional[str], model_dtype):
    """The at-rest codec object for ``--kv-offload-codec`` (None: store the pool's pages as they are)."""
    if not name:
        return None
    from ...kvcache import get_kv_codec

    return get_kv_codec(name, model_dtype)
