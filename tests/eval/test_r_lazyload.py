"""R lazy-load database glue over the `rdata` package, on hand-built XDR bytes and the real janeaustenr index."""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bytediet.eval.corpus import NOVELS
from bytediet.eval.r_lazyload import (
    RDataError,
    character_vector,
    decompress_lazyload,
    read_lazyload_db,
    read_rds,
    unserialize,
)

# ------------------------------------------------------------- a tiny XDR writer (serialize.c)
ATTR, TAG = 1 << 9, 1 << 10


def i32(*values: int) -> bytes:
    return struct.pack(f">{len(values)}i", *values)


def header(version: int = 3) -> bytes:
    out = b"X\n" + i32(version, 0x040201, 0x030500 if version == 3 else 0x020300)
    return out + (i32(5) + b"UTF-8" if version == 3 else b"")


def charsxp(s: str | None) -> bytes:
    if s is None:
        return i32(9, -1)
    raw = s.encode("utf-8")
    return i32(9 | (8 << 12), len(raw)) + raw  # levels 8: UTF-8


def strsxp(items: list) -> bytes:
    return i32(16, len(items)) + b"".join(charsxp(s) for s in items)


def nil() -> bytes:
    return i32(254)


def symbol(name: str) -> bytes:
    return i32(1) + charsxp(name)


def named_list(values: list[bytes], names: list[str]) -> bytes:
    names_attr = i32(2 | TAG) + symbol("names") + strsxp(names) + nil()
    return i32(19 | ATTR, len(values)) + b"".join(values) + names_attr


def _rdb_record(payload: bytes, level: int, kind: bytes = b"1") -> bytes:
    length = struct.pack(">I", len(payload))
    if level == 1:
        return length + zlib.compress(payload)
    codec = {b"0": bytes, b"1": zlib.compress, b"2": bz2.compress, b"Z": lzma.compress}[kind]
    return length + kind + codec(payload)


def write_db(base, objects: dict[str, bytes], level: int = 1, kind: bytes = b"1") -> None:
    """``<base>.rdb`` / ``<base>.rdx`` holding each object (an XDR item) as R's makeLazyLoadDB writes it."""
    rdb, offsets = b"", []
    for blob in objects.values():
        record = _rdb_record(header() + blob, level, kind)
        offsets.append((len(rdb), len(record)))
        rdb += record
    variables = named_list([i32(13, 2, off, n) for off, n in offsets], list(objects))
    compressed = i32(10, 1, 1) if level == 1 else i32(14, 1) + struct.pack(">d", level)
    index = named_list([variables, i32(19, 0), compressed], ["variables", "references", "compressed"])
    base.with_suffix(".rdb").write_bytes(rdb)
    base.with_suffix(".rdx").write_bytes(gzip.compress(header() + index))


# ---------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("level,kind", [(1, b"1"), (2, b"2"), (3, b"Z"), (3, b"0")])
def test_lazyload_database_round_trip(tmp_path, level, kind):
    write_db(tmp_path / "Rdata", {"alpha": strsxp(["one", "two"]), "beta": strsxp(["", None, "three"])}, level, kind)
    db = read_lazyload_db(tmp_path / "Rdata")
    assert {k: character_vector(v) for k, v in db.items()} == {"alpha": ["one", "two"], "beta": ["", None, "three"]}
    with pytest.raises(RDataError, match="header says"):
        decompress_lazyload(struct.pack(">I", 3) + zlib.compress(b"ab"), 1)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.one_of(st.none(), st.text(max_size=20)), max_size=30), st.sampled_from([2, 3]))
def test_random_character_vectors_round_trip(strings, version):
    assert character_vector(unserialize(header(version) + strsxp(strings))) == strings


def test_character_vector_rejects_other_values():
    assert character_vector(unserialize(header() + i32(13, 2, 1, 2))) is None  # an integer vector
    assert character_vector(np.array([["a"]])) is None and character_vector(None) is None
    assert character_vector(np.array([1.5, 2.5], dtype=object)) is None


def test_broken_bytes_fail_with_rdata_error(tmp_path):
    with pytest.raises(RDataError, match="Format version 4"):
        unserialize(header(4) + nil())
    with pytest.raises(RDataError):
        unserialize(header() + i32(16, 2) + charsxp("a"))  # truncated
    write_db(tmp_path / "Rdata", {"alpha": strsxp(["one"])})
    rdb = tmp_path / "Rdata.rdb"
    rdb.write_bytes(rdb.read_bytes()[:4] + b"not zlib")
    with pytest.raises(RDataError, match="'alpha' does not decompress"):
        read_lazyload_db(tmp_path / "Rdata")
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(header() + strsxp(["x"])))
    with pytest.raises(RDataError, match="not a lazy-load index"):
        read_lazyload_db(tmp_path / "Rdata")


# The real Rdata.rdx of r-cran-janeaustenr 1.0.0 (written by R 4.2.1): gzip + format version 3.
JANEAUSTENR_RDX = bytes.fromhex(
    "1f8b08000000000000035590d14ac3301486ffa6a9b04267c53dc12e15ef0587973e8182171349db33176dd2926cc21ec237f1"
    "0104f1297c1c414dd390b18b93fcff77c2c99fdce70052709620cd9c4476777b737109b053df18f72357852b067fe4f13cfa41"
    "67cbb7e8f3cf0fb0f765f4c57a06f67d167d79750d3eff8a7ef6f0037eb2804be07c028ec97083168aac13a5bf7c849c941241"
    "174a68bb92d436bd302f011eebce6cd6423f91115545bb80f39e8cdd0a2b3b1dc8b437b2a1ded0f3b69135055a5ad296864556"
    "b2959b9d63bfe10330064cfe42268c3de43eb4af837e1a664e5e8591a26add634218432b32a4eb3da93be5a2584bcd30f41ffb"
    "511c7e91010000"
)


def test_real_r_written_index(tmp_path):
    path = tmp_path / "Rdata.rdx"
    path.write_bytes(JANEAUSTENR_RDX)
    index = read_rds(path)
    variables = {k: v.tolist() for k, v in index["variables"].items()}
    assert sorted(variables) == sorted(NOVELS)
    assert variables["emma"] == [0, 352043] and variables["sensesensibility"] == [1334779, 266556]
    assert index["compressed"].tolist() == [True] and len(index["references"]) == 0


def test_extract_novels_from_a_built_database(tmp_path):
    from bytediet.errors import BytedietError
    from bytediet.eval.corpus import extract_novels

    novels = {name: strsxp([name.upper(), "", None, "line"]) for name in NOVELS}
    write_db(tmp_path / "Rdata", novels)
    assert extract_novels(tmp_path / "Rdata") == {name: f"{name.upper()}\n\n\nline" for name in NOVELS}
    write_db(tmp_path / "Rdata", {**novels, "emma": i32(13, 1, 7)})
    with pytest.raises(BytedietError, match=r"lack the novels \['emma'\]"):
        extract_novels(tmp_path / "Rdata")
