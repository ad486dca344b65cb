"""Build, cache and dispatch of the native library: the fallbacks a user's machine may need."""

import shutil
import warnings

import pytest
import torch
from gguf import GGMLQuantizationType as T

from bytediet.kernels import ops, reference
from bytediet.kernels.cpu import build, dispatch

REAL_CACHE = build.cache_dir()  # before any fixture points the cache elsewhere


@pytest.fixture
def fresh_dispatch(monkeypatch, tmp_path):
    """An empty kernel cache and no loaded library; the process's caches are restored afterwards."""
    monkeypatch.setenv("BYTEDIET_KERNEL_CACHE", str(tmp_path))
    dispatch._native.cache_clear()
    dispatch.load.cache_clear()
    ops._say_reference_once.cache_clear()
    yield tmp_path
    dispatch._native.cache_clear()
    dispatch.load.cache_clear()


def test_without_a_compiler_the_reference_runs_and_one_warning_says_so(fresh_dispatch, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.warns(UserWarning, match="native kernels unavailable.*no C\\+\\+ compiler"):
        assert dispatch.native() is None
    x = torch.randn(2, 64)
    b = torch.zeros(3, 2 * 20, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is said once, not per call
        y = ops.gemm_blocks(int(T.Q4_1), b, x)
    assert torch.equal(y, reference.gemm_blocks(int(T.Q4_1), b, x))
    assert dispatch.describe()["kernels"] == "reference"


def test_reference_can_be_requested(fresh_dispatch, monkeypatch):
    monkeypatch.setenv("BYTEDIET_KERNELS", "reference")
    assert dispatch.native() is None


def test_a_variant_this_cpu_cannot_run_falls_back(fresh_dispatch, monkeypatch):
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"sse2"}))
    with pytest.warns(UserWarning, match="cannot run the avx2 kernels"):
        assert dispatch.native("avx2") is None


def test_variant_choice_follows_the_cpu_flags():
    avx2 = frozenset({"avx2", "fma", "f16c"})
    assert [v.name for v in build.runnable_variants(avx2)] == ["avx2"]
    full = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    assert [v.name for v in build.runnable_variants(full)][-1] == "avx512vnni"
    assert build.runnable_variants(frozenset({"sse4_2"})) == []


@pytest.mark.skipif(build.find_compiler() is None or not build.runnable_variants(), reason="needs g++ and AVX2")
def test_a_corrupt_cached_build_is_rebuilt_not_loaded(fresh_dispatch):
    v = build.variant("avx2")
    built = REAL_CACHE / build.library_path(v, build.find_compiler()).name
    if build.is_intact(built):  # seed the empty cache with `make kernels`' build: one compile in this test, not two
        shutil.copy(built, fresh_dispatch / built.name)
        shutil.copy(built.with_suffix(".sha256"), fresh_dispatch / built.with_suffix(".sha256").name)
    lib = build.build(v)
    assert build.is_intact(lib)
    lib.write_bytes(lib.read_bytes()[:1000])  # truncated, as by a full disk or a killed build
    assert not build.is_intact(lib)
    rebuilt = build.build(v)
    assert rebuilt == lib and build.is_intact(rebuilt)
    loaded = dispatch.native("avx2")
    assert loaded is not None and loaded.isa == "avx2"


def test_cache_key_changes_with_the_sources(monkeypatch, tmp_path):
    compiler = build.find_compiler()
    if compiler is None:
        pytest.skip("no compiler")
    v = build.variant("avx2")
    before = build.library_path(v, compiler)
    monkeypatch.setattr(build, "source_hash", lambda: "edited")
    assert build.library_path(v, compiler) != before
