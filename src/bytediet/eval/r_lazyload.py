"""Read an R lazy-load database (``<base>.rdb`` + ``<base>.rdx``): the `rdata` package parses, this file finds.

The ``.rdx`` is an RDS file holding ``list(variables = list(name = c(offset, length)), references, compressed)``;
each variable is its own serialization stored at ``(offset, length)`` in the ``.rdb`` as a 4-byte big-endian
uncompressed length, then the compressed bytes (R's ``R_decompress1..3`` in ``src/main/serialize.c``).
"""

from __future__ import annotations

import bz2
import lzma
import struct
import zlib
from pathlib import Path
from typing import Any

from bytediet.errors import BytedietError

# exceptions the `rdata` parser raises on bytes it cannot read (it has no error class of its own)
_PARSE_ERRORS = (ValueError, LookupError, RuntimeError, EOFError, TypeError, struct.error, zlib.error)


class RDataError(BytedietError):
    """The bytes are not an R serialization that `rdata` can read."""


def unserialize(data: bytes) -> Any:
    """One uncompressed serialization (``unserialize()``) as `rdata` converts it (vectors -> numpy arrays)."""
    import rdata  # imported on use: it pulls in pandas and xarray

    try:
        return rdata.conversion.convert(rdata.parser.parse_data(data, extension=".rds"))
    except _PARSE_ERRORS as exc:
        raise RDataError(f"cannot parse this R serialization ({type(exc).__name__}: {exc})") from exc


def read_rds(path: str | Path) -> Any:
    """``readRDS``: an RDS file (gzip-, bzip2- or xz-compressed, or plain) as `rdata` converts it."""
    import rdata

    try:
        return rdata.conversion.convert(rdata.parser.parse_file(path, extension=".rds"))
    except _PARSE_ERRORS as exc:
        raise RDataError(f"cannot parse the RDS file {path} ({type(exc).__name__}: {exc})") from exc


def decompress_lazyload(blob: bytes, compressed: int) -> bytes:
    """One ``.rdb`` record's serialization; ``compressed`` is the index's flag.

    1/TRUE = zlib after the length; 2 and 3 put a type byte after it ('0' stored, '1' zlib, '2' bzip2, 'Z' xz).
    """
    if compressed == 0:
        return blob
    expected = struct.unpack(">I", blob[:4])[0]
    if compressed == 1:
        out = zlib.decompress(blob[4:])
    else:
        kind, payload = blob[4:5], blob[5:]
        decoders = {b"0": bytes, b"1": zlib.decompress, b"2": bz2.decompress, b"Z": lzma.decompress}
        if kind not in decoders:
            raise RDataError(f"unknown lazy-load compression type {kind!r}")
        out = decoders[kind](payload)
    if len(out) != expected:
        raise RDataError(f"lazy-load record decompressed to {len(out)} bytes, header says {expected}")
    return out


def read_lazyload_db(base: str | Path) -> dict[str, Any]:
    """Every variable of the lazy-load database ``<base>.rdb`` / ``<base>.rdx`` as ``{name: value}``."""
    base = Path(base)
    index = read_rds(base.with_suffix(".rdx"))
    if not isinstance(index, dict) or not isinstance(index.get("variables"), dict):
        raise RDataError(f"{base.with_suffix('.rdx')} is not a lazy-load index (no `variables` list)")
    level = int(index["compressed"][0]) if "compressed" in index else 1
    data = base.with_suffix(".rdb").read_bytes()
    out = {}
    for key, where in index["variables"].items():
        name = str(key)  # `rdata` gives numpy strings
        offset, length = (int(v) for v in where)
        try:
            raw = decompress_lazyload(data[offset : offset + length], level)
        except (zlib.error, lzma.LZMAError, OSError, ValueError) as exc:  # bz2 raises OSError / ValueError
            raise RDataError(f"the .rdb record of {name!r} does not decompress ({exc})") from exc
        out[name] = unserialize(raw)
    return out


def character_vector(value: Any) -> list[str | None] | None:
    """An R character vector as converted by `rdata` -> its elements (``None`` = NA); anything else -> None."""
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    if getattr(value, "ndim", 0) != 1:
        return None
    if value.size == 0:  # `rdata` converts character(0) to an empty float array
        return []
    if kind not in ("U", "O"):
        return None
    items = value.tolist()
    return items if all(v is None or isinstance(v, str) for v in items) else None
