"""Sampler: each step against a plain float64 reference, seeded determinism, sample frequencies."""

import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy import stats

from bytediet.engine import sampling
from bytediet.engine.params import SamplingParams
from bytediet.engine.sampling import (
    Sampler,
    apply_penalties,
    draw_uniforms,
    make_generator,
    pad_token_ids,
)
from bytediet.kernels.reference import inverse_cdf

NEG_INF = float("-inf")


# ---- the reference: one row at a time, float64, written from the definitions ----------------
def ref_support_and_probs(logits32: torch.Tensor, p: SamplingParams):
    """Returns (kept mask, probabilities, margin): the margin is how far the row is from a
    top-p / min-p boundary, so rows where float32 rounding could decide are skipped."""
    x = (logits32 / torch.tensor(p.temperature, dtype=torch.float32)).double().numpy()  # same rounding
    V = x.size
    keep = np.isfinite(x) | (x > NEG_INF)
    margin = math.inf
    if 0 < p.top_k < V:
        kth = np.sort(x)[::-1][p.top_k - 1]
        keep &= x >= kth
    if p.top_p < 1.0:
        probs = softmax64(np.where(keep, x, NEG_INF))
        for t in np.flatnonzero(keep):
            mass_above = probs[x > x[t]].sum()  # "more likely" = a larger logit (ties by logit)
            margin = min(margin, abs(mass_above - p.top_p))
            keep[t] = mass_above < p.top_p
    if p.min_p > 0.0:
        probs = softmax64(np.where(keep, x, NEG_INF))
        ratio = probs / probs.max()
        margin = min(margin, np.abs(ratio[keep] - p.min_p).min())
        keep &= ratio >= p.min_p
    return keep, softmax64(np.where(keep, x, NEG_INF)), margin


def softmax64(x):
    e = np.exp(x - x.max())
    return e / e.sum()


logit_values = st.one_of(st.floats(-12, 12, width=32), st.just(NEG_INF), st.sampled_from([0.0, 1.0, 2.5]))


@st.composite
def rows(draw):
    V = draw(st.integers(2, 40))
    logits = draw(st.lists(logit_values, min_size=V, max_size=V))
    assume(any(math.isfinite(v) for v in logits))
    params = SamplingParams(
        temperature=draw(st.sampled_from([0.3, 0.7, 1.0, 1.6])),
        top_k=draw(st.sampled_from([-1, 0, 1, 2, 5, V - 1, V, V + 3])),
        top_p=draw(st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.1, 1e-4])),
        min_p=draw(st.sampled_from([0.0, 0.0, 0.05, 0.3, 0.9])),
    )
    return torch.tensor(logits, dtype=torch.float32), params


@settings(max_examples=120, deadline=None)
@given(batch=st.lists(rows(), min_size=1, max_size=5), candidates=st.sampled_from([1, 3, 8, 1024]))
def test_processed_distribution_matches_reference(batch, candidates):
    V = max(len(row) for row, _ in batch)
    # pad the shorter rows with -inf (a padded vocabulary), as the model's tail columns would be
    logits = torch.full((len(batch), V), NEG_INF)
    for i, (row, _) in enumerate(batch):
        logits[i, : len(row)] = row
    params = [p for _, p in batch]
    with mock.patch.object(sampling, "NUCLEUS_CANDIDATES", candidates):  # partial and full sorts
        probs = Sampler.processed_probs(logits, params)
    for i, p in enumerate(params):
        keep, ref, margin = ref_support_and_probs(logits[i], p)
        assume(margin > 1e-4)
        np.testing.assert_array_equal(probs[i].numpy() > 0, keep & (ref > 0), err_msg=str(p))
        np.testing.assert_allclose(probs[i].double().numpy(), ref, atol=1e-5, err_msg=str(p))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), B=st.integers(1, 6), V=st.integers(1, 300))
def test_greedy_is_argmax_and_consumes_no_randomness(seed, B, V):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 5
    sampler = Sampler(seed=seed)
    before = sampler.generator.get_state().clone()
    own = make_generator(seed + 1)
    own_before = own.get_state().clone()
    out = sampler(logits, [SamplingParams(temperature=0)] * B, generators=[own] + [None] * (B - 1))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert torch.equal(sampler.generator.get_state(), before) and torch.equal(own.get_state(), own_before)


def test_temperature_to_zero_approaches_greedy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 500, generator=g) * 3
    best = logits.argmax(dim=-1)
    gaps = []
    for t in (1.0, 0.3, 0.1, 0.03, 0.01):
        probs = Sampler.processed_probs(logits, [SamplingParams(temperature=t)] * 64)
        gaps.append((1 - probs.gather(1, best[:, None])).max().item())
    assert all(a > b for a, b in zip(gaps, gaps[1:])), gaps  # the top token's mass grows to 1
    out = Sampler(seed=1)(logits, [SamplingParams(temperature=1e-4)] * 64)  # sampled, not greedy
    top2 = logits.topk(2).values
    decided = (top2[:, 0] - top2[:, 1]) > 1e-2  # a gap of 100 temperatures: the rest is < e^-100
    assert torch.equal(out.token_ids[decided], best[decided]) and decided.sum() > 50


def penalise(logits, prompt, output, rep, pres, freq):
    return apply_penalties(
        logits,
        pad_token_ids([a + b for a, b in zip(prompt, output)], logits.shape[1], "cpu"),
        pad_token_ids(output, logits.shape[1], "cpu"),
        rep,
        pres,
        freq,
    )


def test_penalties_against_hand_computed_numbers():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    prompt, output = [[0]], [[1, 3, 3]]
    got = penalise(logits, prompt, output, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]))
    # token 0 (prompt): 2/2 = 1; token 1 (output once): -1*2 - 0.25 - 0.5 = -2.75;
    # token 3 (output twice): 3/2 - 2*0.25 - 0.5 = 0.5; tokens 2 and 4 unseen: unchanged
    torch.testing.assert_close(got, torch.tensor([[1.0, -2.75, 0.5, 0.5, -2.0]]))
    # through the sampler: the penalties move greedy's choice from token 3 to token 0
    p = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    assert Sampler()(logits, [p], prompt, output).token_ids.tolist() == [0]
    assert Sampler()(logits, [SamplingParams(temperature=0)], prompt, output).token_ids.tolist() == [3]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), B=st.integers(1, 5), V=st.integers(1, 30), data=st.data())
def test_penalties_match_dense_count_formula(seed, B, V, data):
    ids = st.lists(st.integers(0, V - 1), max_size=12)
    prompt = [data.draw(ids) for _ in range(B)]
    output = [data.draw(ids) for _ in range(B)]
    rep = torch.tensor(data.draw(st.lists(st.floats(0.2, 3.0), min_size=B, max_size=B)))
    pres = torch.tensor(data.draw(st.lists(st.floats(-2, 2), min_size=B, max_size=B)))
    freq = torch.tensor(data.draw(st.lists(st.floats(-2, 2), min_size=B, max_size=B)))
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3
    want = logits.double().clone()
    for b in range(B):
        for t in range(V):
            count = output[b].count(t)
            if count or t in prompt[b]:
                want[b, t] = want[b, t] / rep[b] if want[b, t] > 0 else want[b, t] * rep[b]
            want[b, t] -= freq[b] * count + pres[b] * (count > 0)
    torch.testing.assert_close(penalise(logits, prompt, output, rep, pres, freq).double(), want, atol=1e-5, rtol=1e-5)


def test_repetition_penalty_matches_transformers():
    hf = pytest.importorskip("transformers.generation.logits_process")
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g) * 4
    ids = torch.randint(0, 50, (4, 12), generator=g)
    want = hf.RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())
    zero = torch.zeros(4)
    got = penalise(logits, ids[:, :7].tolist(), ids[:, 7:].tolist(), torch.full((4,), 1.7), zero, zero)
    torch.testing.assert_close(got, want)


def test_pad_token_ids_with_ragged_rows():
    padded = pad_token_ids([[1, 1, 4], [], torch.tensor([0, 4, 4, 4])], 5, "cpu")
    assert padded.tolist() == [[1, 1, 4, 5], [5, 5, 5, 5], [0, 4, 4, 4]]
    assert pad_token_ids([[], []], 7, "cpu").tolist() == [[7], [7]]


def test_seeded_request_is_the_same_alone_and_in_a_batch():
    V = 97
    g = torch.Generator().manual_seed(11)
    seeded = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=1234)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3),
        SamplingParams(min_p=0.1, seed=7),
        SamplingParams(temperature=0.5, top_p=0.5, presence_penalty=1.0),
    ]
    steps = [torch.randn(1 + len(others), V, generator=g) * 2 for _ in range(50)]
    hist = [[] for _ in range(1 + len(others))]

    def run(batch_rows, shared_seed):
        sampler = Sampler(seed=shared_seed)
        gens = [make_generator(p.seed) for p in batch_rows]
        for row in hist:
            row.clear()
        picks = []
        for logits in steps:
            order = [0] + list(range(1, len(batch_rows)))
            out = sampler(logits[order], batch_rows, [[1, 2]] * len(batch_rows), hist[: len(batch_rows)], gens)
            for i, t in enumerate(out.token_ids.tolist()):
                hist[i].append(t)
            picks.append(out.token_ids[0].item())
        return picks

    alone = run([seeded], 0)
    assert run([seeded] + others, 5) == alone
    assert run([seeded] + others[:2], 99) == alone
    assert len(set(alone)) > 5  # it really sampled
    # and the seeded row sits anywhere in the batch: put it last
    sampler = Sampler(seed=3)
    gens = [None, make_generator(seeded.seed)]
    last = [sampler(torch.stack([s[1], s[0]]), [others[1], seeded], generators=gens).token_ids[1].item() for s in steps]
    assert last == alone


def test_sample_frequencies_match_processed_distribution():
    V, N = 12, 40_000
    logits = torch.linspace(-2.0, 2.0, V).flip(0)
    params = SamplingParams(temperature=0.8, top_k=9, top_p=0.97, min_p=0.02)
    want = Sampler.processed_probs(logits[None], [params])[0].double()
    out = Sampler(seed=2024)(logits.expand(N, V), [params] * N)  # N unseeded rows share one generator
    counts = torch.bincount(out.token_ids, minlength=V).double()
    support = want > 0
    assert counts[~support].sum() == 0 and support.sum() >= 5
    expected = want[support] / want[support].sum() * N
    chi2 = stats.chisquare(counts[support].numpy(), expected.numpy())
    assert chi2.pvalue > 1e-3, (counts, want * N)


def test_inverse_cdf_is_exact_on_a_skewed_distribution():
    probs = torch.tensor([0.6, 0.0, 0.25, 0.1, 0.0, 0.05])
    g = make_generator(5)
    draws = inverse_cdf(probs.expand(30_000, 6), draw_uniforms([g] * 30_000, "cpu"))
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[1] == 0 and counts[4] == 0
    expected = probs[probs > 0].double() / probs.double().sum() * 30_000
    chi2 = stats.chisquare(counts[probs > 0].numpy(), expected.numpy())
    assert chi2.pvalue > 1e-3


def test_inverse_cdf_never_picks_a_zero_probability_token_at_the_ends():
    probs = torch.tensor([[0.0, 0.0, 0.25, 0.0, 0.75, 0.0, 0.0]] * 4)
    u = torch.tensor([0.0, 0.25, 0.25 - 1e-12, 1.0], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [2, 4, 2, 4]


def test_each_row_consumes_one_number_of_its_generator():
    g, ref = make_generator(9), make_generator(9)
    Sampler()(torch.randn(3, 10), [SamplingParams(seed=9)] * 3, generators=[g, None, None])
    torch.rand(1, generator=ref, dtype=torch.float64)
    assert torch.equal(g.get_state(), ref.get_state())


def test_logprobs_are_raw_log_softmax_with_ranks_and_top_n():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 64, generator=g) * 3
    params = [
        SamplingParams(temperature=0.7, top_k=5, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(logprobs=None),
        SamplingParams(temperature=1.2, top_p=0.5, logprobs=64),
    ]
    out = Sampler(seed=0)(logits, params, [[0, 1]] * 4, [[2]] * 4)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        t = out.token_ids[i].item()
        assert lp.token_id == t
        assert lp.logprob == pytest.approx(ref[i, t].item(), abs=1e-5)
        assert lp.rank == 1 + int((ref[i] > ref[i, t]).sum())
        n = params[i].logprobs
        assert len(lp.top) == n
        want_ids = ref[i].argsort(descending=True)[:n].tolist()
        assert [tok for tok, _ in lp.top] == want_ids
        np.testing.assert_allclose([v for _, v in lp.top], ref[i, want_ids].numpy(), atol=1e-5)
    assert out.logprobs[1].rank == 1 and out.logprobs[1].top == ()


def test_penalties_need_the_token_history():
    with pytest.raises(ValueError, match="prompt_ids and output_ids"):
        Sampler()(torch.zeros(1, 4), [SamplingParams(presence_penalty=1.0)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_logits_with_cpu_generators_give_the_cpu_tokens():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 3000, generator=g) * 4
    params = [SamplingParams(temperature=0.8, top_k=100, top_p=0.9, seed=i) for i in range(6)]
    cpu = Sampler(seed=0)(logits, params, generators=[make_generator(i) for i in range(6)]).token_ids
    gpu = Sampler(seed=0)(logits.cuda(), params, generators=[make_generator(i) for i in range(6)]).token_ids
    assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)


def test_logits_processors_mask_their_row_and_keep_raw_logprobs():
    """A row's processor sees its output ids and (V,) logits; other rows and the reported logprobs are untouched."""
    seen = []

    def only_token_3(output_ids, row):
        seen.append(list(output_ids))
        out = torch.full_like(row, float("-inf"))
        out[3] = row[3]
        return out

    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0], [5.0, 1.0, 0.0, -1.0]])
    params = [
        SamplingParams(temperature=0, logprobs=1, logits_processors=(only_token_3,)),
        SamplingParams(temperature=0, logprobs=1),
    ]
    out = Sampler()(logits, params, prompt_ids=[[1], [1]], output_ids=[[7, 8], [9]])
    assert out.token_ids.tolist() == [3, 0] and seen == [[7, 8]]
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[3].item())
    assert logits[0, 0] == 5.0  # the caller's logits are not modified


def test_logits_processors_are_validated_and_not_serialised():
    from bytediet.errors import ConfigError

    with pytest.raises(ConfigError, match="logits_processors"):
        SamplingParams(logits_processors=("not callable",))
    params = SamplingParams(logits_processors=(lambda ids, row: row,))
    assert "logits_processors" not in params.to_dict()
    assert SamplingParams.from_dict(params.to_dict()) == params  # compare=False: processors are not identity


@pytest.mark.parametrize("vocab", [7, 256, 1000, 49152 + 3])
def test_two_level_inverse_cdf_picks_what_one_running_sum_picks(vocab):
    """The block-then-token search equals a float64 running sum over the whole row, zero-probability runs too."""
    g = torch.Generator().manual_seed(vocab)
    probs = (torch.randn(16, vocab, generator=g) * 3).softmax(dim=-1)
    probs[:, vocab // 3 : vocab // 3 + 300] = 0  # a run of zeros that may span a whole block
    u = torch.rand(16, generator=g, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 1e-17
    cdf = probs.double().cumsum(dim=-1)
    expected = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1).clamp(max=vocab - 1)
    got = inverse_cdf(probs, u)
    assert (probs.gather(1, got.unsqueeze(1)) > 0).all()
    assert got[2:].tolist() == expected[2:].tolist()
