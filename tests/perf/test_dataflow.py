"""Dataflow traffic: hand-checked 4x4x4 GEMM and a brute-force loop-nest simulation."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bytediet.errors import ConfigError
from bytediet.perf.dataflow import analyze_gemm, best_tiling, traffic


def test_hand_checked_4x4x4():
    # elements and accumulators of 1 byte so bytes = element transfers
    os_ = traffic("output_stationary", 4, 4, 4, (2, 2, 1), 1, 1)
    assert (os_.bytes_a, os_.bytes_b, os_.bytes_c, os_.footprint) == (32, 32, 16, 8)
    ws = traffic("weight_stationary", 4, 4, 4, (1, 2, 2), 1, 1)
    assert (ws.bytes_a, ws.bytes_b, ws.bytes_c, ws.footprint) == (32, 16, 48, 8)  # C: 2 writes + 1 read back
    is_ = traffic("input_stationary", 4, 4, 4, (2, 1, 4), 1, 1)
    assert (is_.bytes_a, is_.bytes_b, is_.bytes_c, is_.footprint) == (16, 32, 16, 14)
    r = analyze_gemm(4, 4, 4, sram_bytes=8, elem_bytes=1, acc_bytes=1)
    assert r["dataflows"]["output_stationary"]["total_bytes"] == 80
    assert r["dataflows"]["weight_stationary"]["total_bytes"] == 96
    assert r["dataflows"]["input_stationary"]["total_bytes"] == 96
    assert r["best"] == "output_stationary"
    # with room for a whole operand every dataflow reaches the compulsory traffic (each element once)
    big = analyze_gemm(4, 4, 4, sram_bytes=64, elem_bytes=1, acc_bytes=1)
    assert all(d["total_bytes"] == 48 == big["compulsory_bytes"] for d in big["dataflows"].values())


def _simulate(dataflow: str, m: int, n: int, k: int, tile: tuple[int, int, int], e: int, acc: int) -> tuple:
    """Count element transfers by walking the loop nest tile by tile (ragged edges included)."""
    tm, tn, tk = tile
    a = b = c = 0
    if dataflow == "output_stationary":
        for i0 in range(0, m, tm):
            for j0 in range(0, n, tn):
                rows, cols = min(tm, m - i0), min(tn, n - j0)
                for _ in range(k):
                    a += rows * e
                    b += cols * e
                c += rows * cols * e
    else:
        stat_dim, other = (n, m) if dataflow == "weight_stationary" else (m, n)
        ts = tn if dataflow == "weight_stationary" else tm
        k_tiles = math.ceil(k / tk)
        for s0 in range(0, stat_dim, ts):
            width = min(ts, stat_dim - s0)
            for kt in range(k_tiles):
                depth = min(tk, k - kt * tk)
                stat = width * depth * e  # the stationary block, loaded once
                streamed = other * depth * e  # every row/column of the other operand streams past
                out_bytes = acc if k_tiles > 1 else e
                c += other * width * out_bytes * (2 if kt > 0 else 1)  # read back partial sums after the first
                if dataflow == "weight_stationary":
                    b, a = b + stat, a + streamed
                else:
                    a, b = a + stat, b + streamed
    return a, b, c


@settings(max_examples=60, deadline=None)
@given(
    df=st.sampled_from(["output_stationary", "weight_stationary", "input_stationary"]),
    m=st.integers(1, 12),
    n=st.integers(1, 12),
    k=st.integers(1, 12),
    tm=st.integers(1, 12),
    tn=st.integers(1, 12),
    tk=st.integers(1, 12),
    e=st.sampled_from([1, 2]),
)
def test_formula_matches_loop_nest_simulation(df, m, n, k, tm, tn, tk, e):
    tile = (min(tm, m), min(tn, n), min(tk, k))
    t = traffic(df, m, n, k, tile, e, 4)
    assert (t.bytes_a, t.bytes_b, t.bytes_c) == _simulate(df, m, n, k, tile, e, 4)


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 64), n=st.integers(1, 64), k=st.integers(1, 64), sram=st.integers(16, 4096))
def test_best_tile_fits_and_never_beats_compulsory(m, n, k, sram):
    r = analyze_gemm(m, n, k, sram)
    for name, row in r["dataflows"].items():
        if row is None:
            continue
        assert row["footprint"] <= sram
        assert row["total_bytes"] >= r["compulsory_bytes"] - 1e-9
        assert best_tiling(name, m, n, k, sram).total_bytes == row["total_bytes"]


def test_more_sram_never_means_more_traffic():
    small = analyze_gemm(512, 512, 512, 16 * 1024)
    large = analyze_gemm(512, 512, 512, 256 * 1024)
    for name in small["dataflows"]:
        assert large["dataflows"][name]["total_bytes"] <= small["dataflows"][name]["total_bytes"]
    os_ = "output_stationary"
    assert large["dataflows"][os_]["total_bytes"] < small["dataflows"][os_]["total_bytes"]


def test_rejects_bad_input():
    with pytest.raises(ConfigError):
        analyze_gemm(0, 4, 4, 100)
    with pytest.raises(ConfigError):
        traffic("diagonal_stationary", 4, 4, 4, (1, 1, 1))
