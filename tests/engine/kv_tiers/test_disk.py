"""The disk tier: checksummed files, LRU within its size, restart, corrupt / foreign files, full disk, the lock."""

from __future__ import annotations

import errno
import logging
import subprocess
import sys
import time

import pytest
import torch

from bytediet.engine.kv_tiers.disk import HEADER, DiskTier
from bytediet.errors import ConfigError

SALT, OTHER_SALT = b"s" * 32, b"o" * 32
BLOCK = 256
FILE = HEADER.size + BLOCK


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def data(i: int) -> torch.Tensor:
    return torch.full((BLOCK,), i, dtype=torch.uint8)


def tier(root, capacity=10 * FILE, salt=SALT) -> DiskTier:
    return DiskTier(root, salt, capacity, BLOCK, {"model": "test"})


def test_round_trip_and_lru_eviction_order(tmp_path):
    d = tier(tmp_path, capacity=3 * FILE)
    for i in range(3):
        assert d.write(key(i), data(i))
    assert torch.equal(d.read(key(0)), data(0))  # 0 is now the most recently used: 1 goes first
    d.write(key(3), data(3))
    assert key(1) not in d and not d.path(key(1)).exists()
    assert [k for k in d.index] == [key(2), key(0), key(3)]
    assert d.bytes == 3 * FILE
    d.close()


def test_a_restart_finds_the_blocks_in_lru_order(tmp_path):
    d = tier(tmp_path)
    for i in range(3):
        d.write(key(i), data(i))
        time.sleep(0.01)
    d.read(key(0))  # touched: newest
    d.close()
    again = tier(tmp_path)
    assert list(again.index) == [key(1), key(2), key(0)]
    assert torch.equal(again.read(key(2)), data(2))
    again.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "empty"])
def test_a_damaged_or_foreign_file_is_ignored_with_a_warning_and_deleted(tmp_path, damage, caplog):
    d = tier(tmp_path)
    d.write(key(1), data(1))
    path = d.path(key(1))
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-5] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:-10]
    elif damage == "empty":
        raw = b""
    else:  # written by another model / version: same size, another salt in the header
        other = tier(tmp_path / "x", salt=OTHER_SALT)
        other.write(key(1), data(1))
        raw = other.path(key(1)).read_bytes()
        other.close()
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="bytediet.kv_tiers"):
        assert d.read(key(1)) is None
    assert "ignoring" in caplog.text and not path.exists() and key(1) not in d
    d.close()


def test_files_of_the_wrong_size_are_dropped_at_start(tmp_path, caplog):
    d = tier(tmp_path)
    d.write(key(1), data(1))
    d.write(key(2), data(2))
    d.close()
    with open(d.path(key(1)), "ab") as f:
        f.write(b"x")
    with caplog.at_level(logging.WARNING, logger="bytediet.kv_tiers"):
        again = tier(tmp_path)
    assert key(1) not in again and key(2) in again and "wrong size" in caplog.text
    again.close()


def test_a_full_disk_drops_the_block_and_warns_once(tmp_path, monkeypatch, caplog):
    d = tier(tmp_path)
    real_open = open

    def full(path, mode="r", *a, **k):
        if "w" in mode and ".tmp" in str(path):
            f = real_open(path, mode, *a, **k)
            f.write(b"partial")
            f.close()
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr("builtins.open", full)
    with caplog.at_level(logging.WARNING, logger="bytediet.kv_tiers"):
        assert not d.write(key(1), data(1))
        assert not d.write(key(2), data(2))
    monkeypatch.undo()
    assert caplog.text.count("cannot write") == 1 and d.write_errors == 2
    assert not list(tmp_path.rglob("*.tmp*")) and not list(tmp_path.rglob("*.kv"))
    assert d.write(key(3), data(3))  # space again: it works again
    d.close()


def test_another_models_cache_in_the_directory_is_ignored_and_said_once(tmp_path, caplog):
    other = tier(tmp_path, salt=OTHER_SALT)
    other.write(key(1), data(1))
    other.close()
    with caplog.at_level(logging.WARNING, logger="bytediet.kv_tiers"):
        d = tier(tmp_path)
    assert key(1) not in d and caplog.text.count("another model") == 1
    d.close()


def test_bad_settings_are_one_line_errors(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot write there"):
        tier(blocker / "cache")
    with pytest.raises(ConfigError, match="below one block"):
        tier(tmp_path, capacity=FILE - 1)


def test_a_second_process_on_the_same_directory_is_refused_clearly(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys; from tests.engine.kv_tiers.test_disk import tier; "
                f"t = tier({str(tmp_path)!r}); print('ready', flush=True); sys.stdin.read()"
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(ConfigError, match=r"in use by bytediet pid \d+"):
            tier(tmp_path)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    d = tier(tmp_path)  # the first one has gone: the directory is free again
    d.close()
