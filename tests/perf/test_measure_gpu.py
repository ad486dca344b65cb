"""The GPU's measured ceilings as a roofline hardware entry (the probes themselves need a GPU)."""

from __future__ import annotations

import pytest
import torch

from bytediet.perf.measure_gpu import measure_gpu, spec_from_gpu_measurement
from bytediet.perf.roofline import analyze
from tests.conftest import tiny_config


def _measurement(**over) -> dict:
    m = {
        "version": 1,
        "host": "h",
        "gpu": "NVIDIA H200",
        "cpu": "NVIDIA H200",
        "threads": 0,
        "torch": "2.11",
        "measured_at": "now",
        "read_bandwidth": 4.0e12,
        "copy_bandwidth": 4.3e12,
        "memory_bytes": 141e9,
        "llc_bytes": 60e6,
        "peak_flops": {"bf16": 790e12, "fp16": 790e12, "fp32": 50e12, "tf32": 390e12},
    }
    return {**m, **over}


def test_a_measured_gpu_predicts_in_bf16_from_its_read_bandwidth():
    hw = spec_from_gpu_measurement(_measurement())
    assert hw.measured and hw.memory_bandwidth == 4.0e12 and "H200" in hw.name
    pred = analyze(tiny_config("llama"), hw, weights=16.0, kv=16.0, batch=1, context=64)
    assert pred.compute_dtype == "bf16"  # not the float32 a measured CPU computes in
    more = analyze(
        tiny_config("llama"),
        spec_from_gpu_measurement(_measurement(read_bandwidth=8.0e12)),
        weights=16.0,
        kv=16.0,
        batch=1,
        context=64,
    )
    assert more.decode_tokens_per_s > pred.decode_tokens_per_s  # decode follows the measured bandwidth


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a CUDA GPU (bench/device_check.py runs it)")
def test_measure_gpu_probes_this_gpu():
    m = measure_gpu("cuda", read_mib=256)
    assert m["read_bandwidth"] > 1e11 and m["peak_flops"]["bf16"] > 1e12
