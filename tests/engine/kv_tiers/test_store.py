"""The tier store: RAM LRU within its size, write-through to disk, loads, and the load-or-recompute policy."""

from __future__ import annotations

import torch

from bytediet.engine.kv_tiers.disk import DiskTier
from bytediet.engine.kv_tiers.store import TierStore

BLOCK = 64


class FakePages:
    """Blocks of a pool as a dict of byte tensors."""

    block_bytes = BLOCK

    def __init__(self) -> None:
        self.pool = {i: torch.full((BLOCK,), i, dtype=torch.uint8) for i in range(16)}

    def read(self, block_id, first_position):
        return self.pool[block_id].clone()

    def write(self, block_id, data, first_position):
        self.pool[block_id] = data.clone()

    def read_many(self, block_ids, first_positions):
        return [self.read(b, p) for b, p in zip(block_ids, first_positions)]

    def write_many(self, block_ids, datas, first_positions):
        for b, d, p in zip(block_ids, datas, first_positions):
            self.write(b, d, p)


def store(ram_blocks=3, disk_dir=None) -> TierStore:
    disk = None if disk_dir is None else DiskTier(disk_dir, b"s" * 32, 1 << 20, BLOCK, {})
    return TierStore(FakePages(), b"s" * 32, 4, ram_blocks * BLOCK, disk)


def test_ram_tier_evicts_least_recently_used_first():
    s = store(ram_blocks=3)
    keys = [s.key(None, [i]) for i in range(4)]
    for i in range(3):
        s.save(keys[i], i, 0)
    s.save(keys[0], 0, 0)  # already held: touched, not copied again
    s.save(keys[3], 3, 0)
    assert list(s.ram) == [keys[2], keys[0], keys[3]] and s.ram_bytes == 3 * BLOCK
    assert s.find([keys[0], keys[1]]) == ["ram"]
    s.close()


def test_a_load_puts_the_saved_bytes_into_other_blocks(tmp_path):
    s = store(ram_blocks=1, disk_dir=tmp_path)
    k1, k2 = s.key(None, [1]), s.key(None, [2])
    s.save(k1, 1, 0)
    s.save(k2, 2, 0)  # k1 leaves RAM; both went to disk
    s.flush()
    assert s.find([k1, k2]) == ["disk", "ram"]
    load = s.start([(k1, "disk", 10, 0), (k2, "ram", 11, 4)])
    while not load.done():
        s.wait(0.01)
    assert s.finish(load) == 2
    assert torch.equal(s.pages.pool[10], s.pages.pool[1]) and torch.equal(s.pages.pool[11], s.pages.pool[2])
    assert s.stats["disk"].hit_tokens == 4 and s.stats["ram"].hit_tokens == 4
    assert s.seconds_per_byte["disk"] is not None
    s.close()


def test_a_lost_block_stops_the_load_there(tmp_path):
    s = store(ram_blocks=0, disk_dir=tmp_path)
    k1, k2 = s.key(None, [1]), s.key(None, [2])
    s.save(k1, 1, 0)
    s.save(k2, 2, 0)
    s.flush()
    s.disk.path(k1).unlink()
    load = s.start([(k1, "disk", 10, 0), (k2, "disk", 11, 4)])
    while not load.done():
        s.wait(0.01)
    assert s.finish(load) == 0
    s.close()


def test_policy_loads_only_when_the_measured_load_beats_the_measured_prefill():
    s = store()
    assert s.worth("disk", 4)  # nothing measured yet: try it, and measure
    s.observe_prefill(tokens=100, seconds=1.0)  # 10 ms a token → 40 ms for a block of 4
    s.seconds_per_byte["disk"] = 0.050 / BLOCK  # 50 ms a block: slower than recomputing
    s.seconds_per_byte["ram"] = 1e-6 / BLOCK
    assert not s.worth("disk", 3) and s.worth("ram", 3)
    s.close()


def test_a_disk_writer_that_falls_behind_drops_evictions_but_not_the_shutdown_flush(tmp_path, monkeypatch):
    import time

    s = store(ram_blocks=0, disk_dir=tmp_path)
    real_write = s.disk.write
    monkeypatch.setattr(s.disk, "write", lambda key, data: (time.sleep(0.01), real_write(key, data))[1])
    keys = [s.key(None, [i]) for i in range(80)]
    for i, k in enumerate(keys[:70]):
        s.save(k, i % 16, 0)  # faster than the disk: beyond 64 queued blocks, dropped
    dropped = s.dropped_writes
    assert dropped > 0
    for i, k in enumerate(keys[70:]):  # the queue is still full: these wait for the writer
        s.save(k, i % 16, 0, wait=True)
    s.flush()
    assert s.dropped_writes == dropped and all(k in s.disk for k in keys[70:])
    s.close()


def _one_block_on_disk(tmp_path):
    """A store with no RAM tier and block 1's pages saved to its disk tier, and their key."""
    s = store(ram_blocks=0, disk_dir=tmp_path)
    k1 = s.key(None, [1])
    s.save(k1, 1, 0)
    s.flush()
    return s, k1


def test_a_cancelled_load_writes_no_block(tmp_path, monkeypatch):
    import threading

    s, k1 = _one_block_on_disk(tmp_path)
    gate = threading.Event()
    real_read = s.disk.read
    monkeypatch.setattr(s.disk, "read", lambda key: (gate.wait(5), real_read(key))[1])
    before = s.pages.pool[9].clone()
    load = s.start([(k1, "disk", 9, 0)])
    assert not load.done()  # the read waits on the loader thread; the engine goes on
    s.cancel(load)  # its request left
    gate.set()
    load.job.result(timeout=5)
    assert torch.equal(s.pages.pool[9], before)
    s.close()


def _record_writing_threads(s, monkeypatch) -> list:
    """The names of the threads that write the store's pages, one a call, in order."""
    import threading

    threads = []
    real = s.pages.write_many
    monkeypatch.setattr(
        s.pages, "write_many", lambda *a: (threads.append(threading.current_thread().name), real(*a))[1]
    )
    return threads


def test_ram_hits_are_copied_on_the_loader_thread_unless_measured_to_copy_in_a_moment(monkeypatch):
    import threading

    s = store(ram_blocks=4)
    k1, k2 = s.key(None, [1]), s.key(None, [2])
    s.save_many([(k1, 1, 0), (k2, 2, 4)])
    threads = _record_writing_threads(s, monkeypatch)
    load = s.start([(k1, "ram", 12, 0), (k2, "ram", 13, 4)])  # nothing measured yet: the loader copies
    load.job.result(timeout=5)
    assert s.finish(load) == 2 and threads == ["kv-tiers-loader_0"]
    assert torch.equal(s.pages.pool[12], s.pages.pool[1]) and torch.equal(s.pages.pool[13], s.pages.pool[2])
    assert s.stats["ram"].hit_tokens == 8 and s.seconds_per_byte["ram"] is not None
    s.seconds_per_byte["ram"] = 1e-9  # 64 ns a block: copied at once, the load is done when start returns
    load = s.start([(k1, "ram", 14, 0)])
    assert load.done() and threads[-1] == threading.current_thread().name and s.finish(load) == 1
    assert torch.equal(s.pages.pool[14], s.pages.pool[1])
    s.seconds_per_byte["ram"] = 1.0  # a slow copy (64 s a block) stays off the engine's thread
    load = s.start([(k2, "ram", 15, 4)])
    load.job.result(timeout=5)
    assert threads[-1] == "kv-tiers-loader_0" and s.finish(load) == 1
    s.close()


def test_a_load_that_reads_the_disk_stays_on_the_loader_thread_however_fast(tmp_path, monkeypatch):
    s, k1 = _one_block_on_disk(tmp_path)
    threads = _record_writing_threads(s, monkeypatch)
    s.seconds_per_byte["ram"] = s.seconds_per_byte["disk"] = 1e-12
    load = s.start([(k1, "disk", 9, 0)])
    load.job.result(timeout=5)
    assert s.finish(load) == 1 and threads == ["kv-tiers-loader_0"]
    assert torch.equal(s.pages.pool[9], s.pages.pool[1])
    s.close()
