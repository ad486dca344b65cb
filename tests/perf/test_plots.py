import pytest

from bytediet.perf.plots import concurrency_series, plot_concurrency


def stats(tps: float, ttft: float | None = 0.1) -> dict:
    return {
        "ttft_p50_s": ttft,
        "ttft_p99_s": None if ttft is None else 2 * ttft,
        "tpot_p50_s": 0.01,
        "tpot_p99_s": 0.02,
        "output_tokens_per_s": tps,
    }


def test_concurrency_series_keeps_only_systems_with_a_sweep_and_orders_levels_as_ints():
    systems = {
        "bytediet": {"concurrency": {"16": stats(90.0), "1": stats(30.0)}},
        "llama.cpp": {"concurrency": {"1": stats(25.0)}},
        "transformers": {"single": {}},
        "gone": {"available": False},
    }
    series = concurrency_series(systems)
    assert set(series) == {"bytediet", "llama.cpp"}
    assert sorted(series["bytediet"]) == [1, 16] and series["bytediet"][16]["output_tokens_per_s"] == 90.0


@pytest.mark.parametrize("gap", [False, True])
def test_plot_concurrency_writes_a_png_even_with_missing_points(tmp_path, gap):
    series = {
        "bytediet": {1: stats(30.0), 4: stats(60.0, None if gap else 0.2)},
        "llama-server": {1: stats(28.0), 4: stats(50.0)},
    }
    path = plot_concurrency(series, tmp_path / "sub" / "c.png", "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
