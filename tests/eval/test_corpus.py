"""Austen corpus (the novels read from the real R package) and disjoint calibration / evaluation windows."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bytediet.errors import BytedietError, ConfigError
from bytediet.eval import corpus
from bytediet.eval.corpus import NOVELS, SEGMENTS, load_corpus, make_windows


# ------------------------------------------------------------------------------------ windows
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(400, 5000),
    len_a=st.integers(1, 40),
    len_b=st.integers(1, 40),
    seed_a=st.integers(0, 2**31),
    seed_b=st.integers(0, 2**31),
)
def test_calibration_and_eval_windows_never_overlap(n, len_a, len_b, seed_a, seed_b):
    ids = torch.randint(0, 1000, (n,))
    cal = make_windows(ids, len_a, split="calibration", seed=seed_a)
    ev = make_windows(ids, len_b, split="eval", seed=seed_b)
    cal_pos = {p for w in cal for p in range(w.start, w.stop)}
    ev_pos = {p for w in ev for p in range(w.start, w.stop)}
    assert not cal_pos & ev_pos
    for windows in (cal, ev):
        assert sum(len(w.ids) for w in windows) == len({p for w in windows for p in range(w.start, w.stop)})
        assert all(torch.equal(w.ids, ids[w.start : w.stop]) for w in windows)
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
    assert austen["prideprejudice"].startswith(
        "PRIDE AND PREJUDICE\n\nBy Jane Austen\n\n\n\nChapter 1\n\n\nIt is a truth universally acknowledged"
    )
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


@pytest.mark.slow
def test_extract_novels_from_the_real_package(tmp_path, austen):
    """The .rdb/.rdx of r-cran-janeaustenr (apt-get download) decode to the cached texts, line for line."""
    try:
        base = corpus._download_rdata(tmp_path)
    except BytedietError as exc:
        pytest.skip(f"could not download r-cran-janeaustenr ({exc})")
    assert corpus.extract_novels(base) == austen
