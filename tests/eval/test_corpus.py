"""R-serialization reader on hand-built and real R-written bytes; Austen corpus; disjoint windows."""
from __future__ import annotations

import bz2
import gzip
import lzma
import math
import shutil
import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bytediet.errors import BytedietError, ConfigError
from bytediet.eval import corpus
from bytediet.eval.corpus import NOVELS, SEGMENTS, load_corpus, make_windows
from bytediet.eval.rdata import (RDataError, RObject, RSymbol, decompress_lazyload, read_lazyload_db, read_rds,
                                 unserialize)

# ------------------------------------------------------------- a tiny XDR writer (serialize.c)
ATTR, TAG = 1 << 9, 1 << 10
NA_INT = -(2**31)


def i32(*values: int) -> bytes:
    return struct.pack(f">{len(values)}i", *values)


def header(version: int = 3) -> bytes:
    out = b"X\n" + i32(version, 0x040201, 0x030500 if version == 3 else 0x020300)
    return out + (i32(5) + b"UTF-8" if version == 3 else b"")


def charsxp(s: str | None, enc: str = "utf8") -> bytes:
    if s is None:
        return i32(9, -1)
    levels = {"utf8": 8, "latin1": 4, "ascii": 64, "native": 0}[enc]
    raw = s.encode("latin-1" if enc == "latin1" else "utf-8")
    return i32(9 | (levels << 12), len(raw)) + raw


def strsxp(items: list, flags: int = 0, attrs: bytes = b"", enc: str = "utf8") -> bytes:
    return i32(16 | flags, len(items)) + b"".join(charsxp(s, enc) for s in items) + attrs


def nil() -> bytes:
    return i32(254)


def symbol(name: str) -> bytes:
    return i32(1) + charsxp(name, "ascii")


def pairlist(entries: list[tuple[bytes | None, bytes]]) -> bytes:
    """entries: (tag bytes or None, value bytes); a CONS chain ending in R_NilValue."""
    return b"".join(i32(2) + value if tag is None else i32(2 | TAG) + tag + value for tag, value in entries) + nil()


def names_attr(names: list[str], name_tag: bytes | None = None) -> bytes:
    return pairlist([(name_tag or symbol("names"), strsxp(names))])


def named_list(values: list[bytes], names: list[str], name_tag: bytes | None = None) -> bytes:
    return i32(19 | ATTR, len(values)) + b"".join(values) + names_attr(names, name_tag)


# ------------------------------------------------------------------------------- decoder tests
def test_character_vector_with_na_and_encodings():
    blob = header(3) + strsxp(["PRIDE AND PREJUDICE", "", None, "caf\u00e9 \u00a3"])
    assert unserialize(blob) == RObject("character", ["PRIDE AND PREJUDICE", "", None, "caf\u00e9 \u00a3"])
    latin = header(2) + strsxp(["na\u00efve", "\u00c3\u00a9"], enc="latin1")  # c3 a9: valid UTF-8 too
    assert unserialize(latin).value == ["na\u00efve", "\u00c3\u00a9"]
    native = header(3) + strsxp(["\u00e9"], enc="native")  # unflagged: the stream's native encoding
    assert unserialize(native).value == ["\u00e9"]


def test_numeric_vectors_and_na():
    na_real = struct.pack(">II", 0x7FF00000, 1954)
    blob = header() + i32(19, 4) + i32(13, 3, 1, NA_INT, -7) + i32(14, 2) + struct.pack(">d", 2.5) + na_real \
        + i32(10, 3, 1, 0, NA_INT) + i32(24, 3) + b"\x00\x7f\xff"
    ints, reals, logicals, raw = unserialize(blob).value
    assert ints.value == [1, None, -7]
    assert reals.value[0] == 2.5 and math.isnan(reals.value[1])
    assert logicals.value == [True, False, None]
    assert raw.value == [0, 127, 255]


def test_named_list_attributes_and_symbol_reference():
    inner = named_list([strsxp(["x"])], ["a"])  # installs the symbol `names` as reference 1
    blob = header() + named_list([inner, strsxp(["y"])], ["first", "second"], name_tag=i32(255 | (1 << 8)))
    obj = unserialize(blob)
    assert obj.names == ["first", "second"]
    assert obj.as_dict()["first"].as_dict() == {"a": RObject("character", ["x"])}
    with pytest.raises(RDataError):
        unserialize(header() + i32(19, 1) + nil()).as_dict()  # unnamed list has no dict form


def test_pairlist_tags_and_long_vector_length():
    blob = header() + pairlist([(symbol("u"), strsxp(["1"])), (i32(255 | (1 << 8)), strsxp(["2"]))])
    obj = unserialize(blob)
    assert obj.kind == "pairlist" and obj.tags == ["u", "u"]
    two = pairlist([(symbol("u"), nil()), (symbol("v"), nil()), (i32(255 | (2 << 8)), nil()),
                    (i32(255) + i32(1), nil())])  # reference 2 packed in the flags; reference 1 after them
    assert unserialize(header() + two).tags == ["u", "v", "v", "u"]
    assert unserialize(header() + symbol("x")) == RSymbol("x")
    long_form = header() + i32(16, -1, 0, 2) + charsxp("a") + charsxp("b")
    assert unserialize(long_form).value == ["a", "b"]


def _altrep(cls: str, state: bytes, vtype: int) -> bytes:
    info = pairlist([(None, symbol(cls)), (None, symbol("base")), (None, i32(13, 1, vtype))])
    return i32(238) + info + state + nil()


def test_altrep_compact_sequences_deferred_strings_and_wrappers():
    seq = header() + _altrep("compact_intseq", i32(14, 3) + struct.pack(">3d", 4, 10, -1), 13)
    assert unserialize(seq) == RObject("integer", [10, 9, 8, 7])
    deferred_state = i32(2) + i32(13, 3, 1, 20, NA_INT) + i32(13, 1, 0)  # CONS(arg, info): improper
    deferred = header() + _altrep("deferred_string", deferred_state, 16)
    assert unserialize(deferred).value == ["1", "20", None]
    wrapped = header() + _altrep("wrap_string", i32(19, 2) + strsxp(["w", None]) + i32(13, 2, 0, 0), 16)
    assert unserialize(wrapped).value == ["w", None]


def test_malformed_streams_fail_clearly():
    with pytest.raises(RDataError, match="XDR"):
        unserialize(b"A\n" + header()[2:] + nil())
    with pytest.raises(RDataError, match="version"):
        unserialize(header(4) + nil())
    with pytest.raises(RDataError, match="truncated"):
        unserialize(header() + i32(16, 2) + charsxp("a"))
    with pytest.raises(RDataError, match="not supported"):
        unserialize(header() + i32(3))  # a closure


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.none(), st.text(max_size=20)), max_size=30), st.sampled_from([2, 3]))
def test_random_character_vectors_round_trip(strings, version):
    assert unserialize(header(version) + strsxp(strings)).value == strings


def _rdb_record(payload: bytes, level: int, kind: bytes = b"1") -> bytes:
    length = struct.pack(">I", len(payload))
    if level == 1:
        return length + zlib.compress(payload)
    codec = {b"0": bytes, b"1": zlib.compress, b"2": bz2.compress, b"Z": lzma.compress}[kind]
    return length + kind + codec(payload)


@pytest.mark.parametrize("level,kind", [(1, b"1"), (2, b"2"), (3, b"Z"), (3, b"0")])
def test_lazyload_database_round_trip(tmp_path, level, kind):
    objects = {"alpha": strsxp(["one", "two"]), "beta": strsxp(["", None, "three"])}
    rdb, offsets = b"", []
    for blob in objects.values():
        record = _rdb_record(header() + blob, level, kind)
        offsets.append((len(rdb), len(record)))
        rdb += record
    variables = named_list([i32(13, 2, off, n) for off, n in offsets], list(objects))
    compressed = i32(10, 1, 1) if level == 1 else i32(14, 1) + struct.pack(">d", level)
    index = named_list([variables, i32(19, 0), compressed], ["variables", "references", "compressed"])
    (tmp_path / "Rdata.rdb").write_bytes(rdb)
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(header() + index))
    db = read_lazyload_db(tmp_path / "Rdata")
    assert {k: v.value for k, v in db.items()} == {"alpha": ["one", "two"], "beta": ["", None, "three"]}
    with pytest.raises(RDataError, match="header says"):
        decompress_lazyload(struct.pack(">I", 3) + zlib.compress(b"ab"), 1)


# The real Rdata.rdx of r-cran-janeaustenr 1.0.0 (written by R 4.2.1): gzip + format version 3.
JANEAUSTENR_RDX = bytes.fromhex(
    "1f8b08000000000000035590d14ac3301486ffa6a9b04267c53dc12e15ef0587973e8182171349db33176dd2926cc21ec237f1"
    "0104f1297c1c414dd390b18b93fcff77c2c99fdce70052709620cd9c4476777b737109b053df18f72357852b067fe4f13cfa41"
    "67cbb7e8f3cf0fb0f765f4c57a06f67d167d79750d3eff8a7ef6f0037eb2804be07c028ec97083168aac13a5bf7c849c941241"
    "174a68bb92d436bd302f011eebce6cd6423f91115545bb80f39e8cdd0a2b3b1dc8b437b2a1ded0f3b69135055a5ad296864556"
    "b2959b9d63bfe10330064cfe42268c3de43eb4af837e1a664e5e8591a26add634218432b32a4eb3da93be5a2584bcd30f41ffb"
    "511c7e91010000")


def test_real_r_written_index(tmp_path):
    path = tmp_path / "Rdata.rdx"
    path.write_bytes(JANEAUSTENR_RDX)
    index = read_rds(path).as_dict()
    variables = {k: v.value for k, v in index["variables"].as_dict().items()}
    assert sorted(variables) == sorted(NOVELS)
    assert variables["emma"] == [0, 352043] and variables["sensesensibility"] == [1334779, 266556]
    assert index["compressed"].value == [True] and index["references"].value == []


# ------------------------------------------------------------------------------------ windows
@settings(max_examples=40, deadline=None)
@given(n=st.integers(400, 5000), len_a=st.integers(1, 40), len_b=st.integers(1, 40),
       seed_a=st.integers(0, 2**31), seed_b=st.integers(0, 2**31))
def test_calibration_and_eval_windows_never_overlap(n, len_a, len_b, seed_a, seed_b):
    ids = torch.randint(0, 1000, (n,))
    cal = make_windows(ids, len_a, split="calibration", seed=seed_a)
    ev = make_windows(ids, len_b, split="eval", seed=seed_b)
    cal_pos = {p for w in cal for p in range(w.start, w.stop)}
    ev_pos = {p for w in ev for p in range(w.start, w.stop)}
    assert not cal_pos & ev_pos
    for windows in (cal, ev):
        assert sum(len(w.ids) for w in windows) == len({p for w in windows for p in range(w.start, w.stop)})
        assert all(torch.equal(w.ids, ids[w.start:w.stop]) for w in windows)
    # the eval split owns 8 of 10 segments: most of the stream is covered when windows are short
    assert len(ev_pos) >= 0.8 * n - SEGMENTS * len_b - 1


def test_windows_are_seeded_and_deterministic():
    ids = list(range(10_000))
    a = make_windows(ids, 64, 20, split="eval", seed=3)
    b = make_windows(torch.tensor(ids), 64, 20, split="eval", seed=3)
    c = make_windows(ids, 64, 20, split="eval", seed=4)
    assert [w.start for w in a] == [w.start for w in b] == sorted(w.start for w in a)
    assert all(torch.equal(x.ids, y.ids) and x.ids.dtype == torch.long for x, y in zip(a, b))
    assert [w.start for w in a] != [w.start for w in c]
    assert len(make_windows(ids, 100, split="calibration")) == 20  # 2 segments of 1000 tokens


def test_windows_reject_impossible_requests():
    with pytest.raises(ConfigError, match="longer corpus"):
        make_windows(list(range(100)), 64, 1)
    with pytest.raises(ConfigError, match="split"):
        make_windows(list(range(100)), 4, 1, split="train")


# ------------------------------------------------------------------------------------- corpus
def test_user_text_file_and_unknown_names(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("It was a dark and stormy night.\n", encoding="utf-8")
    assert load_corpus(path) == load_corpus(str(path)) == "It was a dark and stormy night.\n"
    with pytest.raises(ConfigError, match="neither a file"):
        load_corpus(tmp_path / "missing.txt")
    with pytest.raises(ConfigError, match="unknown novel"):
        corpus.novel_text("lady_susan")


def test_missing_package_says_how_to_supply_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("BYTEDIET_CACHE", str(tmp_path))
    monkeypatch.setattr(corpus, "INSTALLED_RDATA", tmp_path / "nowhere" / "Rdata")
    monkeypatch.setattr(corpus.shutil, "which", lambda _: None)
    with pytest.raises(BytedietError, match="--corpus"):
        corpus.fetch_austen()


@pytest.fixture(scope="module")
def austen():
    cached = all((corpus.cache_dir() / f"{n}.txt").is_file() for n in NOVELS)
    if not cached and (shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None):
        pytest.skip("Austen corpus not cached and apt-get/dpkg-deb are unavailable to fetch r-cran-janeaustenr")
    try:
        corpus.fetch_austen()
    except BytedietError as exc:
        pytest.skip(f"could not fetch r-cran-janeaustenr via apt ({exc})")
    return {name: load_corpus(name) for name in NOVELS}


def test_real_austen_novels(austen):
    assert len(austen) == 6
    assert austen["prideprejudice"].startswith("PRIDE AND PREJUDICE\n\nBy Jane Austen\n\n\n\nChapter 1\n\n\n"
                                               "It is a truth universally acknowledged")
    assert austen["emma"].startswith("EMMA\n\nBy Jane Austen")
    assert austen["sensesensibility"].startswith("SENSE AND SENSIBILITY\n\nby Jane Austen")
    assert all(len(text) > 400_000 and "\n\n" in text for text in austen.values())
    assert austen["prideprejudice"].count("\n") + 1 == 13030  # one line per element of the R vector
    assert load_corpus("austen") == "\n\n\n".join(austen[n] for n in NOVELS)


def test_real_corpus_windows_disjoint(austen):
    ids = list(austen["persuasion"].encode("utf-8"))  # bytes stand in for tokens: no tokenizer needed
    cal = make_windows(ids, 512, 16, split="calibration", seed=0)
    ev = make_windows(ids, 512, 64, split="eval", seed=0)
    assert max(w.stop for w in cal) <= len(ids)
    spans = sorted((w.start, w.stop) for w in cal + ev)
    assert all(a_stop <= b_start for (_, a_stop), (b_start, _) in zip(spans, spans[1:]))
    assert [w.start for w in ev] == [w.start for w in make_windows(ids, 512, 64, split="eval", seed=0)]
