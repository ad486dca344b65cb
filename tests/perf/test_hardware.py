"""Hardware catalogue and this machine's measurement (cache, re-measure)."""

from __future__ import annotations

import functools

import pytest

from bytediet.errors import BytedietError, ConfigError
from bytediet.perf import measure as measure_mod
from bytediet.perf.hardware import DTYPES, HARDWARE, HardwareSpec, get_hardware

CATALOGUE = ["h100-sxm", "h200", "b200", "mi300x", "mi350x", "tpu-v6e", "tpu-v7", "groq-lpu"]


def test_every_device_is_registered():
    assert set(CATALOGUE + ["this-machine"]) <= set(HARDWARE.names())


@pytest.mark.parametrize("hw_id", CATALOGUE)
def test_every_number_has_a_source_and_dense_peaks_are_below_sparse(hw_id):
    hw = get_hardware(hw_id)
    assert hw.id == hw_id and not hw.measured
    assert hw.sources["peak_flops"].startswith("https://")
    for key in ("memory_bytes", "memory_bandwidth", "interconnect_bandwidth", "onchip_bytes", "onchip_bandwidth"):
        if getattr(hw, key) is not None:
            assert hw.sources[key].startswith("https://"), key
    assert set(hw.peak_flops) <= set(DTYPES)
    for dtype, sparse in hw.sparse_peak_flops.items():
        assert sparse == pytest.approx(2 * hw.peak_flops[dtype], rel=0.01)
    # HBM accelerators are far richer in FLOPs than in bytes; the SRAM-only LPU is the exception
    assert (hw.ridge_point("bf16") < 10) == (hw_id == "groq-lpu")


def test_published_figures():
    assert get_hardware("h100-sxm").memory_bandwidth == 3.35e12
    assert get_hardware("h100-sxm").peak("bf16") == 989.4e12  # dense, not the 1979 sparse figure
    v7 = get_hardware("tpu-v7")
    assert (v7.memory_bytes, v7.memory_bandwidth) == (192e9, 7.37e12)
    assert get_hardware("b200").peak("fp4") == 9e15
    groq = get_hardware("groq-lpu")
    assert groq.chips_to_hold(140e9) == 609  # 140 GB of FP16 70B weights over 230 MB SRAM chips


def test_dtype_fallback_goes_wider_never_narrower():
    h100 = get_hardware("h100-sxm")
    assert h100.compute_dtype("fp4") == "fp8"  # Hopper has no FP4 units
    assert get_hardware("tpu-v6e").compute_dtype("fp8") == "bf16"
    assert get_hardware("groq-lpu").compute_dtype("bf16") == "fp16"
    with pytest.raises(ConfigError):
        HardwareSpec("bad", "bad", {"fp64": 1.0}, 1.0, 1.0)


@pytest.fixture
def quick_measure(monkeypatch, tmp_path):
    """Point the cache at a temp dir and make the probes small; count how often they run."""
    calls = []
    real = functools.partial(measure_mod.measure, read_mib=16)

    def fake(threads=2):
        calls.append(threads)
        return real(threads)

    monkeypatch.setenv("BYTEDIET_CACHE", str(tmp_path))
    monkeypatch.setattr(measure_mod, "measure", fake)
    return calls


def test_this_machine_measures_once_then_uses_the_cache(quick_measure, tmp_path):
    with pytest.raises(BytedietError, match="--measure"):
        measure_mod.this_machine(measure_if_missing=False)
    spec = measure_mod.this_machine(measure_if_missing=True)
    assert spec.measured and spec.id == "this-machine"
    assert spec.memory_bandwidth > 1e8 and spec.peak("fp32") > 1e8
    assert list(tmp_path.glob("hardware-*.json"))
    again = get_hardware("this-machine")
    assert len(quick_measure) == 1 and again.memory_bandwidth == spec.memory_bandwidth
    measure_mod.this_machine(remeasure=True)
    assert len(quick_measure) == 2
