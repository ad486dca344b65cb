"""The native sampler (softmax at a temperature, then the two-level inverse CDF) against its twin in
kernels/reference.py, for every ISA variant this CPU can run, on fresh random logits: every token it picks must hold
u · total inside its own float64 CDF interval (a test no rounding boundary can flip, that an off-by-one token fails),
masked tokens are never picked, and the frequencies follow the distribution."""

import pytest
import torch
from scipy import stats

from bytediet.kernels import ops, reference
from bytediet.kernels.cpu import build

VARIANTS = [v.name for v in build.runnable_variants()] if build.find_compiler() else []
pytestmark = pytest.mark.skipif(not VARIANTS, reason="no native kernels on this machine")
NEG_INF = float("-inf")


def cdf_interval(logits: torch.Tensor, inv_t: torch.Tensor, tokens: torch.Tensor) -> tuple:
    """Each row's float64 cumulative mass before and through its token, over the row's total."""
    p = (logits.double() * inv_t.double().unsqueeze(1)).softmax(dim=-1)
    cdf = p.cumsum(dim=-1)
    through = cdf.gather(1, tokens.unsqueeze(1)).squeeze(1)
    before = through - p.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return before / cdf[:, -1], through / cdf[:, -1]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 256), (16, 1000), (4, 49152 + 3), (2, 262144)])
def test_sample_rows_picks_the_token_whose_cdf_interval_holds_u(variant, shape):
    B, V = shape
    gen = torch.Generator().manual_seed(B * 7919 + V)
    logits = torch.randn(B, V, generator=gen) * 4
    inv_t = torch.rand(B, generator=gen) * 2 + 0.25
    u = torch.rand(B, generator=gen, dtype=torch.float64)
    u[0] = 0.0
    got = ops.sample_rows(logits, inv_t, u, variant=variant)
    assert got.shape == (B,) and got.dtype == torch.int64 and ((got >= 0) & (got < V)).all()
    before, through = cdf_interval(logits, inv_t, got)
    assert ((before <= u + 1e-5) & (u <= through + 1e-5)).all(), (before, u, through)
    want = reference.sample_rows(logits, inv_t, u)
    away = ((u - before).abs() > 1e-5) & ((through - u).abs() > 1e-5)  # there the twins pick the same token
    assert torch.equal(got[away], want[away])


@pytest.mark.parametrize("variant", VARIANTS)
def test_sample_rows_never_picks_a_masked_token(variant):
    gen = torch.Generator().manual_seed(5)
    V = 3000
    logits = torch.randn(8, V, generator=gen)
    logits[:, ::2] = NEG_INF  # every other token masked, the last one too
    logits[:, -1] = NEG_INF
    logits[:, 700:1300] = NEG_INF  # whole blocks without mass
    logits[1, :] = NEG_INF
    logits[1, 1001] = 0.5  # one token left inside a masked run
    u = torch.tensor([0.0, 0.5, 1.0 - 1e-17, 0.999999, 1e-12, 0.3, 0.7, 1.0 - 1e-9], dtype=torch.float64)
    got = ops.sample_rows(logits, torch.ones(8), u, variant=variant)
    assert torch.isfinite(logits.gather(1, got.unsqueeze(1))).all(), got
    assert got[1] == 1001


@pytest.mark.parametrize("variant", VARIANTS)
def test_sample_rows_edge_rows(variant):
    logits = torch.full((3, 40), NEG_INF)
    logits[1, 17] = float("nan")
    logits[1, 3] = 2.0
    logits[2] = torch.linspace(-1e4, 0, 40)  # all mass on the last token: the others underflow
    got = ops.sample_rows(logits, torch.ones(3), torch.full((3,), 0.5, dtype=torch.float64), variant=variant)
    assert got.tolist() == [0, 3, 39]  # a row without mass gets token 0; NaN has none


@pytest.mark.parametrize("variant", VARIANTS)
def test_sample_rows_frequencies_follow_the_distribution(variant):
    V, N = 600, 60_000
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(V, generator=gen) * 2
    logits[logits < -1.5] = NEG_INF
    u = torch.rand(N, generator=gen, dtype=torch.float64)
    got = ops.sample_rows(logits.expand(N, V), torch.full((N,), 1 / 0.7), u, variant=variant)
    p = (logits.double() / 0.7).softmax(dim=-1)
    counts = torch.bincount(got, minlength=V).double()
    assert counts[p == 0].sum() == 0
    big = p * N >= 5  # chi-square over the tokens expected often enough, the rest pooled
    observed = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    expected = torch.cat([p[big] * N, (p[~big] * N).sum().unsqueeze(0)])
    assert stats.chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3


def test_other_devices_and_dtypes_take_the_reference():
    logits = torch.randn(3, 50).bfloat16()
    inv_t, u = torch.ones(3), torch.rand(3, dtype=torch.float64)
    assert torch.equal(ops.sample_rows(logits, inv_t, u), reference.sample_rows(logits, inv_t, u))
