"""The fused native GELU-tanh · up against its twin in kernels/reference.py, for every ISA variant this CPU can
run, on fresh random inputs: odd lengths (tails past the 8-lane vector), one parallel region and several,
zeros, huge and tiny values."""

import pytest
import torch

from bytediet.kernels import ops, reference
from bytediet.kernels.cpu import build

VARIANTS = [v.name for v in build.runnable_variants()] if build.find_compiler() else []
pytestmark = pytest.mark.skipif(not VARIANTS, reason="no native kernels on this machine")


FUSED = ["gelu_tanh_mul", "silu_mul"]  # act(gate) · up: GELU-tanh (gemma3), SiLU (llama, qwen2)
EXTREMES = [0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 10.0, -10.0, 50.0, -50.0, 80.0, -80.0, 1e4, -1e4, 3e38, 0.5]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("shape", [(1, 7), (3, 37), (5, 2048), (17, 1151)])
def test_fused_activation_equals_reference(variant, name, shape):
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1] + len(name))
    gate = torch.randn(*shape, generator=gen) * 3.0
    up = torch.randn(*shape, generator=gen)
    got = getattr(ops, name)(gate, up, variant=variant)
    want = getattr(reference, name)(gate.double(), up.double())
    assert got.shape == shape and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= 2e-6 * (gate.double().abs() * up.double().abs()) + 1e-30).all()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", FUSED)
def test_fused_activation_extreme_values(variant, name):
    gate = torch.tensor(EXTREMES + ([-3e38] if name == "gelu_tanh_mul" else []))
    up = torch.ones_like(gate)
    got = getattr(ops, name)(gate, up, variant=variant)
    want = getattr(reference, name)(gate.double(), up.double())
    assert torch.isfinite(got).all()
    assert ((got.double() - want).abs() <= 2e-6 * gate.double().abs() + 1e-30).all()
    zeros = getattr(ops, name)(torch.zeros(3, 40), torch.randn(3, 40), variant=variant)
    assert torch.equal(zeros.abs(), torch.zeros(3, 40))


@pytest.mark.parametrize("name", FUSED)
def test_other_dtypes_take_the_reference(name):
    gate, up = torch.randn(4, 9).bfloat16(), torch.randn(4, 9).bfloat16()
    assert torch.equal(getattr(ops, name)(gate, up), getattr(reference, name)(gate, up))


@pytest.mark.parametrize("name", FUSED)
def test_fused_activations_keep_autograd(name):
    gate, up = torch.randn(4, 64, requires_grad=True), torch.randn(4, 64)
    getattr(ops, name)(gate, up).sum().backward()
    assert gate.grad is not None and torch.isfinite(gate.grad).all()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", [(1, 64), (3, 7, 256), (70, 640), (5, 13)])
def test_rms_norm_equals_reference(variant, shape):
    gen = torch.Generator().manual_seed(shape[-1] + len(shape))
    x = torch.randn(*shape, generator=gen) * 4
    x[0, ..., :] *= 1e-3  # a small row beside ordinary ones
    w = torch.randn(shape[-1], generator=gen)
    got = ops.rms_norm(x, w, 1e-6, variant=variant)
    want = reference.rms_norm(x.double(), w.double(), 1e-6)
    assert got.shape == x.shape and torch.allclose(got.double(), want, rtol=2e-6, atol=1e-6)
    assert torch.equal(ops.rms_norm(torch.zeros(2, shape[-1]), w, 1e-6, variant=variant), torch.zeros(2, shape[-1]))


def test_rms_norm_keeps_autograd():
    x = torch.randn(4, 64, requires_grad=True)
    w = torch.randn(64)
    ops.rms_norm(x, w, 1e-6).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
