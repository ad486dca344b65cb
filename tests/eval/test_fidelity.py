"""Fidelity metrics against independent computations (scipy, numpy, torch.distributions)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import log_softmax as sp_log_softmax
from scipy.special import rel_entr, softmax
from torch.distributions import Categorical, kl_divergence

from bytediet.errors import ConfigError
from bytediet.eval import fidelity
from bytediet.eval.fidelity import (
    FidelityAccumulator,
    kl_per_position,
    mean_nll,
    next_token_pairs,
    perplexity,
    tail_stats,
    token_nll,
    top1_agreement,
    top1_match,
)


def random_logits(seed: int, rows: int, vocab: int, scale: float, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * scale).to(dtype)


logit_cases = st.tuples(
    st.integers(0, 2**31), st.integers(1, 12), st.integers(2, 300), st.sampled_from([0.01, 1.0, 5.0, 60.0])
)


@settings(max_examples=50, deadline=None)
@given(logit_cases, st.sampled_from([torch.float32, torch.float64]))
def test_nll_and_perplexity_match_scipy(case, dtype):
    seed, rows, vocab, scale = case
    logits = random_logits(seed, rows, vocab, scale, dtype)
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(seed + 1))
    ref = -sp_log_softmax(logits.double().numpy(), axis=-1)[np.arange(rows), targets.numpy()]
    np.testing.assert_allclose(token_nll(logits, targets).numpy(), ref, rtol=1e-10, atol=1e-12)
    assert mean_nll(logits, targets) == pytest.approx(ref.mean(), rel=1e-10, abs=1e-12)
    assert perplexity(logits, targets) == pytest.approx(math.exp(ref.mean()), rel=1e-10)
    cat = Categorical(logits=logits.double())
    np.testing.assert_allclose(
        token_nll(logits, targets).numpy(), -cat.log_prob(targets).numpy(), rtol=1e-9, atol=1e-12
    )


@settings(max_examples=50, deadline=None)
@given(logit_cases, st.floats(0.0, 2.0))
def test_kl_matches_scipy_rel_entr_and_torch_distributions(case, noise):
    seed, rows, vocab, scale = case
    ref = random_logits(seed, rows, vocab, scale)
    test = ref + random_logits(seed + 7, rows, vocab, noise)
    kl = kl_per_position(ref, test)
    p, q = softmax(ref.double().numpy(), axis=-1), softmax(test.double().numpy(), axis=-1)
    expected = rel_entr(p, q).sum(axis=-1)
    np.testing.assert_allclose(kl.numpy(), expected, rtol=1e-7, atol=1e-12)
    torch_kl = kl_divergence(Categorical(logits=ref.double()), Categorical(logits=test.double()))
    np.testing.assert_allclose(kl.numpy(), torch_kl.clamp_min(0).numpy(), rtol=1e-7, atol=1e-12)
    assert kl.dtype == torch.float64 and bool((kl >= 0).all())


@settings(max_examples=30, deadline=None)
@given(logit_cases)
def test_top1_agreement_matches_numpy(case):
    seed, rows, vocab, scale = case
    ref = random_logits(seed, rows, vocab, scale)
    test = random_logits(seed + 3, rows, vocab, scale) + ref
    expected = np.argmax(ref.numpy(), axis=-1) == np.argmax(test.numpy(), axis=-1)
    assert top1_match(ref, test).tolist() == expected.tolist()
    assert top1_agreement(ref, test) == pytest.approx(expected.mean())


def test_identical_logits_give_zero_kl_and_full_agreement():
    logits = random_logits(0, 9, 1000, 30.0)
    assert torch.equal(kl_per_position(logits, logits.clone()), torch.zeros(9, dtype=torch.float64))
    assert top1_agreement(logits, logits.clone()) == 1.0
    shifted = logits.double() + 123.0  # softmax is shift-invariant per row
    assert float(kl_per_position(logits.double(), shifted).max()) < 1e-12


def test_extreme_and_infinite_logits_stay_finite_where_defined():
    ref = torch.tensor([[1e4, 0.0, -1e4], [0.0, float("-inf"), 1.0]])
    test = torch.tensor([[1e4 - 1.0, 1.0, -1e4], [0.5, 2.0, 1.0]])
    kl = kl_per_position(ref, test)
    assert torch.isfinite(kl).all()
    expected = rel_entr(softmax(ref.double().numpy(), axis=-1), softmax(test.double().numpy(), axis=-1)).sum(-1)
    np.testing.assert_allclose(kl.numpy(), expected, rtol=1e-9, atol=1e-300)
    # the test model rules out a token the reference allows: the divergence is infinite
    assert math.isinf(float(kl_per_position(test[1:], ref[1:])[0]))


def test_chunked_rows_equal_unchunked(monkeypatch):
    ref, test = random_logits(1, 37, 50, 3.0), random_logits(2, 37, 50, 3.0)
    targets = torch.randint(0, 50, (37,))
    whole_kl, whole_nll = kl_per_position(ref, test), token_nll(test, targets)
    monkeypatch.setattr(fidelity, "COMPARE_CHUNK_ELEMENTS", 120)  # 2 rows per chunk
    assert torch.equal(kl_per_position(ref, test), whole_kl)
    assert torch.equal(token_nll(test, targets), whole_nll)


def test_tail_stats_match_torch_quantile():
    values = torch.rand(1001, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) ** 3
    stats = tail_stats(values)
    q = torch.quantile(values, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    assert (stats.p50, stats.p90, stats.p99) == pytest.approx(q.tolist(), rel=1e-12)
    assert stats.mean == pytest.approx(float(values.mean())) and stats.max == float(values.max())
    assert stats.count == 1001
    exact = tail_stats(list(range(101)))  # order statistics 0..100: percentiles are the values
    assert (exact.p50, exact.p90, exact.p99, exact.max, exact.mean) == (50, 90, 99, 100, 50)
    with pytest.raises(ConfigError):
        tail_stats([])


def test_next_token_pairs_and_shape_errors():
    logits, ids = torch.randn(5, 7), torch.tensor([3, 1, 4, 1, 5])
    rows, targets = next_token_pairs(logits, ids)
    assert torch.equal(rows, logits[:4]) and targets.tolist() == [1, 4, 1, 5]
    with pytest.raises(ConfigError):
        next_token_pairs(logits, ids[:4])
    with pytest.raises(ConfigError):
        kl_per_position(logits, logits[:, :6])
    with pytest.raises(ConfigError):
        token_nll(logits, ids[:3])
    with pytest.raises(ConfigError):
        token_nll(torch.randn(7), ids)


def test_accumulator_equals_whole_stream_and_ranks_worst_windows():
    vocab, acc = 64, FidelityAccumulator(keep_worst=3)
    refs, tests, targets = [], [], []
    for w in range(6):
        ref = random_logits(10 + w, 8 + w, vocab, 2.0)
        test = ref + random_logits(50 + w, 8 + w, vocab, 0.1 * (w + 1) * (-1) ** w)
        tgt = torch.randint(0, vocab, (8 + w,), generator=torch.Generator().manual_seed(w))
        result = acc.add(test, tgt, ref_logits=ref, name=f"w{w}")
        assert result.mean_kl == pytest.approx(float(kl_per_position(ref, test).mean()))
        refs.append(ref), tests.append(test), targets.append(tgt)
    ref, test, tgt = torch.cat(refs), torch.cat(tests), torch.cat(targets)
    summary = acc.summary()
    assert summary["windows"] == 6 and summary["tokens"] == len(tgt)
    assert summary["ppl_test"] == pytest.approx(perplexity(test, tgt), rel=1e-12)
    assert summary["ppl_ref"] == pytest.approx(perplexity(ref, tgt), rel=1e-12)
    assert summary["top1_agreement"] == pytest.approx(top1_agreement(ref, test))
    all_kl = kl_per_position(ref, test)
    assert summary["kl"]["p99"] == pytest.approx(float(torch.quantile(all_kl, 0.99)), rel=1e-12)
    assert summary["kl"]["mean"] == pytest.approx(float(all_kl.mean()), rel=1e-12)
    means = {f"w{w}": float(kl_per_position(refs[w], tests[w]).mean()) for w in range(6)}
    worst = sorted(means, key=means.get, reverse=True)[:3]
    assert [r["name"] for r in summary["worst"]] == worst == [r.name for r in acc.worst()]


def test_accumulator_without_reference_and_misuse():
    acc = FidelityAccumulator()
    with pytest.raises(ConfigError, match="no windows"):
        acc.summary()
    logits, targets = random_logits(0, 10, 20, 1.0), torch.randint(0, 20, (10,))
    assert acc.add(logits, targets) is None
    summary = acc.summary()
    assert summary["ppl_test"] == pytest.approx(perplexity(logits, targets)) and "kl" not in summary
    with pytest.raises(ConfigError, match="every window or for none"):
        acc.add(logits, targets, ref_logits=logits)
    with pytest.raises(ConfigError, match="at least one"):
        acc.add(logits[:0], targets[:0])
