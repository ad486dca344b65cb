"""The measured choice of the compute-bound GEMM's precision (kernels/dense_gemm.py)."""

from __future__ import annotations

import pytest
import torch

from bytediet.kernels import dense_gemm
from bytediet.kernels.cpu import build


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.delenv(dense_gemm.ENV, raising=False)
    dense_gemm._choice.cache_clear()
    yield monkeypatch
    dense_gemm._choice.cache_clear()


def test_the_environment_fixes_the_choice(fresh):
    fresh.setenv(dense_gemm.ENV, "bf16")
    assert dense_gemm.dtype() == torch.bfloat16 and dense_gemm.describe()["reason"] == f"{dense_gemm.ENV}=bf16"
    dense_gemm._choice.cache_clear()
    fresh.setenv(dense_gemm.ENV, "fp32")
    assert dense_gemm.dtype() == torch.float32
    dense_gemm._choice.cache_clear()
    fresh.setenv(dense_gemm.ENV, "fp16")
    with pytest.raises(ValueError, match="int8, fp32, bf16, auto"):
        dense_gemm.dtype()


def test_int8_is_the_default_and_says_when_it_falls_back(fresh):
    fresh.setattr(dense_gemm, "measured_bf16_speedup", lambda: pytest.fail("the default measured"))
    assert dense_gemm.kind() == "int8" and dense_gemm.dtype() == torch.float32  # fp32 where no panel kernel
    d = dense_gemm.describe()
    assert "the default" in d["reason"] or "no AVX-512 VNNI" in d["reason"]
    assert d["dtype"] in ("int8-q16", "fp32")
    fresh.setenv(dense_gemm.ENV, "fp32")
    dense_gemm._choice.cache_clear()
    assert dense_gemm.kind() == "fp32" and dense_gemm.describe()["dtype"] == "fp32"


def test_a_cpu_without_bf16_instructions_never_measures(fresh):
    fresh.setenv(dense_gemm.ENV, "auto")
    fresh.setattr(build, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    fresh.setattr(dense_gemm, "measured_bf16_speedup", lambda: pytest.fail("measured on a CPU without bf16"))
    assert dense_gemm.kind() == "int8" and "no bf16 instruction" in dense_gemm.describe()["reason"]


@pytest.mark.parametrize("speedup,want", [(2.2, "bf16"), (1.1, "int8"), (0.02, "int8")])
def test_auto_takes_bf16_only_when_measured_faster(fresh, speedup, want):
    fresh.setenv(dense_gemm.ENV, "auto")
    fresh.setattr(build, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    fresh.setattr(dense_gemm, "measured_bf16_speedup", lambda: speedup)
    assert dense_gemm.kind() == want and dense_gemm.describe()["speedup"] == speedup


def test_the_measurement_is_a_positive_ratio():
    assert dense_gemm.measured_bf16_speedup(m=32, k=64, n=64, repeats=2) > 0
