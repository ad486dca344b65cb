"""The tier store: moves evicted blocks' bytes between the pool, host RAM and disk; the block manager decides.

``save`` (a block leaves the pool) copies its bytes to the RAM tier at once (before the block is overwritten) and
queues them for the disk tier (write-through, on a writer thread, so a restart finds them). ``find`` says which tier
holds each of a run of keys; ``worth`` is the policy (load only where the measured load time beats the measured
prefill time of those tokens); ``start`` begins a load on the loader thread (disk reads, then every block's bytes
into its pool block in one batch), so the steps of other requests go on meanwhile — except a load all in RAM that is
measured to copy in under ``INLINE_LOAD_S``: that one is copied at once, and its request runs in this step rather
than the next. The blocks belong to the waiting request alone until ``finish`` (on the engine's thread, once the
load is done) hands them to the prefix cache. ``cancel`` stops a load whose request left: its blocks are never
written after it returns.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch

from .disk import DiskTier
from .keys import chain_key

log = logging.getLogger("bytediet.kv_tiers")
TIERS = ("ram", "disk")
EWMA = 0.3  # weight of the newest measurement in the policy's running averages
INLINE_LOAD_S = 0.025  # a RAM load predicted shorter than this is copied on the engine's thread, not the loader's


@dataclass
class TierStats:
    hit_tokens: int = 0  # tokens loaded from this tier into the pool
    skipped_tokens: int = 0  # tokens found here but recomputed (the policy predicted the load slower)
    loads: int = 0
    load_seconds: float = 0.0
    blocks_written: int = 0


@dataclass
class TierLoad:
    """One request's blocks coming back: entries [key, tier, block id, first position, bytes (None: on disk)]."""

    entries: list = field(default_factory=list)
    job: Optional[Future] = None  # the loader thread's work: → (intact leading blocks, disk-read s, copy s)
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while the job writes pool blocks
    cancelled: bool = False

    def done(self) -> bool:
        return self.job is None or self.job.done()


class TierStore:
    def __init__(self, pages, salt: bytes, block_size: int, ram_capacity: int, disk: Optional[DiskTier]) -> None:
        self.pages, self.salt, self.block_size = pages, salt, block_size
        self.ram_capacity, self.disk = ram_capacity, disk
        self.ram: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # least recently used first
        self.ram_bytes = 0
        self.stats = {t: TierStats() for t in TIERS}
        self.miss_tokens = 0  # tokens looked up below the pool and found in no tier
        self.dropped_writes = 0  # blocks the disk writer could not keep up with
        self.seconds_per_byte: dict[str, Optional[float]] = {t: None for t in TIERS}  # measured load cost
        self.seconds_per_token: Optional[float] = None  # measured prefill cost (the engine reports it)
        self._pending_bytes = 0
        self._writes: queue.Queue[Optional[tuple]] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tiers-writer", daemon=True)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-tiers-loader")
        self._wake = threading.Event()
        self._closed = False
        if disk is not None:
            self._writer.start()

    # -- keys ------------------------------------------------------------------------------------------
    @property
    def root(self) -> bytes:
        return self.salt

    def key(self, parent: Optional[bytes], tokens) -> bytes:
        return chain_key(self.salt if parent is None else parent, tokens)

    # -- saving ----------------------------------------------------------------------------------------
    def save(self, key: bytes, block_id: int, first_position: int, wait: bool = False) -> None:
        """A block leaves the pool: keep its bytes (unless a tier has them already). ``wait`` (at shutdown): when
        the disk writer is behind, wait for it instead of keeping the block in RAM only."""
        self.save_many([(key, block_id, first_position)], wait)

    def save_many(self, entries: list[tuple[bytes, int, int]], wait: bool = False) -> None:
        """:meth:`save` for (key, block id, first position) entries, their pages read in one batch."""
        if self._closed:
            return
        todo = []
        for key, block_id, pos in entries:
            if key in self.ram:
                self.ram.move_to_end(key)
            elif self.disk is not None and key in self.disk:
                self.disk.touch(key)
            else:
                todo.append((key, block_id, pos))
        if not todo:
            return
        datas = self.pages.read_many([b for _, b, _ in todo], [p for _, _, p in todo])
        for (key, _, _), data in zip(todo, datas):
            self._put_ram(key, data)
            if self.disk is None:
                continue
            if self._pending_bytes + data.numel() > max(self.ram_capacity, 64 * self.pages.block_bytes):
                if not wait:
                    self.dropped_writes += 1  # the disk is slower than evictions: keep the RAM copy only
                    continue
                self._writes.join()
            self._pending_bytes += data.numel()
            self._writes.put((key, data))

    def _put_ram(self, key: bytes, data: torch.Tensor) -> None:
        if data.numel() > self.ram_capacity:
            return
        self.ram[key] = data
        self.ram_bytes += data.numel()
        while self.ram_bytes > self.ram_capacity:
            _, old = self.ram.popitem(last=False)
            self.ram_bytes -= old.numel()

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            key, data = item
            try:
                if self.disk.write(key, data):
                    self.stats["disk"].blocks_written += 1
            except Exception as exc:  # never let a write kill the thread: that block is simply not kept
                log.warning("KV tiers: a disk write failed (%s)", exc)
            finally:
                self._pending_bytes -= data.numel()
                self._writes.task_done()

    def flush(self) -> None:
        """Wait until every queued disk write is done."""
        if self.disk is not None and self._writer.is_alive():
            self._writes.join()

    # -- finding and loading ---------------------------------------------------------------------------
    def find(self, keys: list[bytes], count: bool = True) -> list[str]:
        """The tier of each key of the longest run of ``keys`` that some tier holds (``count``: a lookup the
        statistics see; False for a look that is not a request's lookup)."""
        tiers = []
        for k in keys:
            if k in self.ram:
                tiers.append("ram")
            elif self.disk is not None and k in self.disk:
                tiers.append("disk")
            else:
                break
        if count:
            self.miss_tokens += (len(keys) - len(tiers)) * self.block_size
        return tiers

    def worth(self, tier: str, num_blocks: int) -> bool:
        """Whether loading ``num_blocks`` from ``tier`` is predicted faster than recomputing their tokens
        (both from measurements; with none yet, loading is tried and measured)."""
        spb, spt = self.seconds_per_byte[tier], self.seconds_per_token
        if spb is None or spt is None:
            return True
        return spb * num_blocks * self.pages.block_bytes < spt * num_blocks * self.block_size

    def skipped(self, tier: str, num_blocks: int) -> None:
        self.stats[tier].skipped_tokens += num_blocks * self.block_size

    def start(self, entries: list[tuple[bytes, str, int, int]]) -> TierLoad:
        """Begin loading (key, tier, block id, first position) entries: RAM bytes are taken now, the rest (disk
        reads, the copy into the pool) happens on the loader thread."""
        load = TierLoad()
        for key, tier, block_id, pos in entries:
            data = self.ram.get(key) if tier == "ram" else None
            if data is not None:
                self.ram.move_to_end(key)
            else:  # on disk (also a RAM block evicted since it was found)
                tier = "disk"
            load.entries.append([key, tier, block_id, pos, data])
        if self._copies_in_line(load):
            load.job = Future()
            load.job.set_result(self._load(load))
        else:
            load.job = self._loader.submit(self._load, load)
        return load

    def _copies_in_line(self, load: TierLoad) -> bool:
        """Whether ``load`` is all in RAM and measured to copy faster than a step would wait for the loader."""
        spb = self.seconds_per_byte["ram"]
        in_ram = all(entry[4] is not None for entry in load.entries)
        return in_ram and spb is not None and spb * len(load.entries) * self.pages.block_bytes < INLINE_LOAD_S

    def _load(self, load: TierLoad) -> tuple[int, float, float]:
        """The loader thread: read what is on disk, then write the leading intact blocks into the pool."""
        t0 = time.perf_counter()
        intact = 0
        for entry in load.entries:
            if entry[4] is None and self.disk is not None and not load.cancelled:
                entry[4] = self.disk.read(entry[0])
            if entry[4] is None:
                break
            intact += 1
        t1 = time.perf_counter()
        with load.lock:
            if not load.cancelled:
                live = load.entries[:intact]
                self.pages.write_many([e[2] for e in live], [e[4] for e in live], [e[3] for e in live])
        t2 = time.perf_counter()
        self._wake.set()
        return intact, t1 - t0, t2 - t1

    def cancel(self, load: TierLoad) -> None:
        """The request left: once this returns, the load writes no pool block."""
        with load.lock:
            load.cancelled = True

    def finish(self, load: TierLoad) -> int:
        """Account a completed load; returns how many leading blocks arrived intact in the pool (the rest, after
        the first block that was lost or corrupt, are left to be recomputed)."""
        n, read_s, copy_s = load.job.result()
        per_tier = {t: 0 for t in TIERS}
        for key, tier, _block_id, _pos, data in load.entries[:n]:
            if tier == "disk":
                self._put_ram(key, data)
            per_tier[tier] += 1
        for tier, blocks in per_tier.items():
            if not blocks:
                continue
            s = self.stats[tier]
            s.hit_tokens += blocks * self.block_size
            s.loads += 1
            seconds = copy_s * blocks / n + (read_s if tier == "disk" else 0.0)
            s.load_seconds += seconds
            self._observe(tier, seconds / (blocks * self.pages.block_bytes))
        return n

    def wait(self, timeout: float) -> None:
        """Sleep until a load completes (or ``timeout``): the engine has nothing else to run."""
        self._wake.wait(timeout)
        self._wake.clear()

    def _observe(self, tier: str, seconds_per_byte: float) -> None:
        old = self.seconds_per_byte[tier]
        self.seconds_per_byte[tier] = seconds_per_byte if old is None else (1 - EWMA) * old + EWMA * seconds_per_byte

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine's measured prefill cost: ``seconds`` for a step that computed ``tokens`` prompt tokens."""
        if tokens <= 0:
            return
        x, old = seconds / tokens, self.seconds_per_token
        self.seconds_per_token = x if old is None else (1 - EWMA) * old + EWMA * x

    # -- introspection and shutdown --------------------------------------------------------------------
    def tier_bytes(self) -> dict[str, int]:
        return {"ram": self.ram_bytes, "disk": self.disk.bytes if self.disk is not None else 0}

    def close(self) -> None:
        """Finish the disk writes, stop the threads, release the directory's lock."""
        if self._closed:
            return
        self._closed = True
        if self.disk is not None:
            self._writes.put(None)
            self._writer.join()
            self.disk.close()
        self._loader.shutdown(wait=True)
