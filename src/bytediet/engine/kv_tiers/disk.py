"""The disk tier: one file per block, each with a header (magic, format version, salt, key, length, CRC-32).

Layout: ``DIR/LOCK`` (held with ``flock`` by the one process using DIR), ``DIR/<salt>/meta.json`` (what wrote it),
``DIR/<salt>/<k0k1>/<key>.kv``. A file whose header or checksum does not match is deleted with a warning, never read
as KV; a write goes to a temporary file renamed into place, so a reader never sees half a block; a full disk drops
that block (the request goes on). LRU within the size: files are touched on a hit, and a restart orders them by
modification time.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import torch

from ...errors import ConfigError
from .keys import FORMAT_VERSION, KEY_BYTES

log = logging.getLogger("bytediet.kv_tiers")
MAGIC = b"BDKV"
HEADER = struct.Struct(f"<4sI32s{KEY_BYTES}sQI")  # magic, version, salt, key, payload bytes, crc32


class DiskTier:
    def __init__(self, root, salt: bytes, capacity: int, block_bytes: int, describe: dict) -> None:
        self.root, self.salt, self.capacity, self.block_bytes = Path(root).expanduser(), salt, capacity, block_bytes
        self.file_bytes = HEADER.size + block_bytes
        if capacity < self.file_bytes:
            raise ConfigError(
                f"--kv-offload-disk-size {capacity} B is below one block ({self.file_bytes} B); "
                "raise it or leave it at its default"
            )
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(self.root / "LOCK", "a+")
        except OSError as exc:
            raise ConfigError(
                f"--kv-offload-dir {self.root}: cannot write there ({exc.strerror}); choose a writable directory"
            ) from None
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.seek(0)
            owner = self._lock_file.read().strip() or "another process"
            self._lock_file.close()
            raise ConfigError(
                f"--kv-offload-dir {self.root} is in use by {owner}; give each server its own directory"
            ) from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(f"bytediet pid {os.getpid()}\n")
        self._lock_file.flush()
        self.ns = self.root / salt.hex()[:32]
        try:
            self.ns.mkdir(exist_ok=True)
            (self.ns / "meta.json").write_text(json.dumps({"format_version": FORMAT_VERSION, **describe}, indent=1))
        except OSError as exc:
            self.close()
            raise ConfigError(
                f"--kv-offload-dir {self.root}: cannot write there ({exc.strerror}); choose a writable directory"
            ) from None
        self._mutex = threading.Lock()
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key → file bytes, least recently used first
        self.bytes = 0
        self.write_errors = 0
        self._warned_full = False
        self._scan()

    # -- start -----------------------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index this salt's files (oldest first); say once that other models' / versions' caches are ignored."""
        others = [p.name for p in self.root.iterdir() if p.is_dir() and p != self.ns]
        if others:
            log.warning(
                "KV tiers: %s also holds %d cache(s) of another model, codec, block size or format version; "
                "they are ignored",
                self.root,
                len(others),
            )
        found = []
        for sub in self.ns.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.glob("*.kv"):
                try:
                    st = f.stat()
                    key = bytes.fromhex(f.stem)
                except (OSError, ValueError):
                    continue
                if st.st_size != self.file_bytes or len(key) != KEY_BYTES:
                    self._discard(f, "wrong size")
                    continue
                found.append((st.st_mtime, key, st.st_size))
            for tmp in sub.glob("*.tmp*"):  # a write cut short by a crash
                tmp.unlink(missing_ok=True)
        for _, key, size in sorted(found):
            self.index[key] = size
            self.bytes += size
        self._evict(0)

    # -- bytes -----------------------------------------------------------------------------------------
    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.ns / h[:2] / f"{h}.kv"

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def touch(self, key: bytes) -> None:
        with self._mutex:
            if key in self.index:
                self.index.move_to_end(key)

    def write(self, key: bytes, data: torch.Tensor) -> bool:
        """Store one block; False (with one warning) when the disk refuses it."""
        with self._mutex:
            if key in self.index:
                self.index.move_to_end(key)
                return True
            self._evict(self.file_bytes)
        path = self.path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        payload = data.numpy()
        header = HEADER.pack(MAGIC, FORMAT_VERSION, self.salt, key, payload.nbytes, zlib.crc32(payload))
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(memoryview(payload))
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self.write_errors += 1
            if not self._warned_full:
                log.warning("KV tiers: cannot write to %s (%s); blocks that do not fit are dropped", self.ns, exc)
                self._warned_full = True
            return False
        with self._mutex:
            self.index[key] = self.file_bytes
            self.bytes += self.file_bytes
        return True

    def read(self, key: bytes) -> Optional[torch.Tensor]:
        """The block's bytes, or None (the file is missing, or corrupt / truncated / foreign: then deleted)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER.size)
                if len(head) != HEADER.size:
                    return self._bad(key, path, "truncated header")
                magic, version, salt, fkey, n, crc = HEADER.unpack(head)
                if magic != MAGIC or version != FORMAT_VERSION or salt != self.salt or fkey != key:
                    return self._bad(key, path, "not a block of this model, codec and format")
                if n != self.block_bytes:
                    return self._bad(key, path, "wrong length")
                out = torch.empty(n, dtype=torch.uint8)
                if f.readinto(memoryview(out.numpy())) != n or f.read(1):
                    return self._bad(key, path, "truncated")
        except FileNotFoundError:
            self._drop(key)
            return None
        except OSError as exc:
            return self._bad(key, path, str(exc))
        if zlib.crc32(out.numpy()) != crc:
            return self._bad(key, path, "checksum mismatch")
        try:
            os.utime(path)  # LRU order survives a restart
        except OSError:
            pass
        self.touch(key)
        return out

    # -- housekeeping ---------------------------------------------------------------------------------
    def _bad(self, key: bytes, path: Path, why: str) -> None:
        self._discard(path, why)
        self._drop(key)

    def _discard(self, path: Path, why: str) -> None:
        log.warning("KV tiers: ignoring %s (%s); it is deleted and the tokens recomputed", path, why)
        path.unlink(missing_ok=True)

    def _drop(self, key: bytes) -> None:
        with self._mutex:
            size = self.index.pop(key, None)
            if size is not None:
                self.bytes -= size

    def _evict(self, room: int) -> None:
        """Delete least recently used files until ``room`` more bytes fit (caller holds the mutex, or is __init__)."""
        while self.index and self.bytes + room > self.capacity:
            key, size = self.index.popitem(last=False)
            self.bytes -= size
            self.path(key).unlink(missing_ok=True)

    def close(self) -> None:
        if not self._lock_file.closed:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
