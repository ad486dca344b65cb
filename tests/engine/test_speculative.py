"""Speculative decoding: the config, prompt lookup, exact greedy output, rejection sampling that keeps the target's
distribution (and a test that fails when the rule is broken), rollback of rejected drafts' blocks."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from bytediet.engine.llm import LLM
from bytediet.engine.params import SamplingParams
from bytediet.engine.sampling import Sampler
from bytediet.engine.speculative import (
    DEFAULT_BATCH_LIMIT,
    AdaptiveDraft,
    BatchLimit,
    NgramProposer,
    SpeculativeConfig,
    verify,
)
from bytediet.errors import ConfigError
from tests.conftest import model_from_state, random_state, tiny_config
from tests.engine.test_engine import assert_same_or_tie

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "bad,field",
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"method": "eagle"}, "method"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "draft_model"}, "model"),
        ({"nope": 1}, "unknown field"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"disable_by_batch_size": True}, "disable_by_batch_size"),
    ],
)
def test_bad_config_is_refused_naming_the_field(bad, field):
    with pytest.raises(ConfigError, match=field):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, **bad})


def test_config_from_json_text():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg.num_speculative_tokens == 3 and cfg.prompt_lookup_min == 2
    with pytest.raises(ConfigError, match="not valid JSON"):
        SpeculativeConfig.parse("{method: ngram}")


def test_the_batch_limit_is_the_configs_else_the_default_until_the_roofline_sets_it():
    assert BatchLimit.of(SpeculativeConfig.parse({**NGRAM, "disable_by_batch_size": 3})) == BatchLimit(3, "config")
    assert BatchLimit.of(SpeculativeConfig.parse(NGRAM)) == BatchLimit(DEFAULT_BATCH_LIMIT, "default")
    assert BatchLimit.from_roofline(3, 4) == BatchLimit(3, "roofline", 15)  # 4 drafts: 5 rows a sequence
    assert BatchLimit.from_roofline(0, 4).sequences == 1  # a lone sequence may always speculate (measured row cost)


# ------------------------------------------------------------------------------------------------ proposals
def test_prompt_lookup_takes_the_longest_recurring_ngram_most_recent_first():
    p = NgramProposer(2, 3)
    assert p.propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # 3-gram [1 2 3], latest earlier match
    assert p.propose([5, 6, 7, 8, 6, 7], 3) == [8, 6, 7]  # 2-gram [6 7]
    assert p.propose([1, 2, 3, 4], 4) == []  # nothing recurs
    assert p.propose([1, 2, 1, 2], 0) == []


def test_adaptive_draft_stops_drafting_when_drafts_are_rejected_and_probes_later():
    a = AdaptiveDraft(4)
    assert 1 <= a.length() < 4  # a prior acceptance of 0.6 pays for a few drafts, not four
    for _ in range(8):
        a.update(4, 0)
    lengths = [a.length() for _ in range(32)]
    assert lengths.count(0) >= 30 and 1 in lengths  # off, with a one-token probe now and then
    for _ in range(8):
        a.update(1, 1)
    assert a.length() == 4


def test_the_draft_length_maximises_tokens_per_step_cost():
    from bytediet.engine.speculative import expected_gain

    assert expected_gain(0.0, 1) < 1 < expected_gain(0.5, 1)  # a rejected draft costs a row; a kept one pays
    assert expected_gain(0.13, 1) < 1  # the open prompts' acceptance: drafting does not pay
    k_best = max(range(1, 9), key=lambda k: expected_gain(0.9, k))
    assert k_best >= 5  # drafts that are nearly always kept: long ones


def test_measured_row_cost_is_the_slope_through_the_plain_step():
    from bytediet.engine.speculative import DRAFT_ROW_COST, VerifyCosts

    costs = VerifyCosts(keep=4)
    assert costs.row_cost() == DRAFT_ROW_COST  # nothing timed yet
    costs.observe(5, 0.0245)
    assert costs.row_cost() == DRAFT_ROW_COST  # no plain step to compare with
    for t in (0.010, 0.011, 0.010, 0.500):  # a hiccup: the median ignores it
        costs.observe(1, t)
    costs.observe(3, 0.0172)
    # slope of (rows − 1, t − t1) through 0: (4 · 0.0140 + 2 · 0.0067) / (16 + 4) = 0.00347 s a row → 0.33 of 0.0105
    assert costs.row_cost() == pytest.approx(0.00347 / 0.0105, rel=1e-2)


def test_the_row_cost_fit_is_kept_between_refits_and_redone_for_a_new_row_count():
    from bytediet.engine.speculative import VerifyCosts

    costs = VerifyCosts(keep=4, refit_every=3)
    for t in (0.010, 0.010, 0.010):
        costs.observe(1, t)
    costs.observe(2, 0.015)  # a row count not seen before: fitted at once
    assert costs.row_cost() == pytest.approx(0.5)
    costs.observe(2, 0.020)
    costs.observe(2, 0.020)
    assert costs.row_cost() == pytest.approx(0.5)  # two observations since the fit: still the last one
    costs.observe(2, 0.020)
    assert costs.row_cost() == pytest.approx(1.0)  # the third: refitted (median of 2 rows 0.020)


def test_a_dearer_draft_row_shortens_the_draft():
    a = AdaptiveDraft(4, acceptance=0.69)
    assert a.length(0.05) == 4  # rows nearly free: draft all four
    assert a.length(0.36) == 2  # Gemma-3's 5-row verify at 2.45 plain steps: two drafts pay best
    assert AdaptiveDraft(4, acceptance=0.3).length(0.36) == 0


# ------------------------------------------------------------------------------------------------ verification
def _emitted(rule, p: torch.Tensor, drafts: list[int], draws: int, seed: int = 0) -> torch.Tensor:
    """Counts (len(drafts) + 1, V) of the token emitted at each position by ``rule`` over many verifications of the
    same rows (each row's target distribution is ``p[j]``), with position j counted when j − 1 drafts were kept."""
    logits = p.log()
    g = torch.Generator().manual_seed(seed)
    sampler, params = Sampler(seed=seed), SamplingParams(temperature=1.0)
    counts = torch.zeros(p.shape)
    for _ in range(draws):
        out = rule(logits, drafts, params, sampler, g).tokens
        for j, tok in enumerate(out):
            counts[j, tok] += 1
    return counts


P = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.1, 0.2], [0.25, 0.25, 0.25, 0.25]])
DRAFTS = [0, 3]  # a likely first draft, an unlikely second one


def _chi2_positions(counts: torch.Tensor) -> list[float]:
    """p-values of each position's emitted tokens against the target's distribution there."""
    out = []
    for j in range(counts.shape[0]):
        n = counts[j].sum()
        if n >= 200:
            out.append(stats.chisquare(counts[j].numpy(), (P[j] * n).numpy()).pvalue)
    return out


def test_rejection_sampling_keeps_the_targets_distribution_at_every_position():
    pvalues = _chi2_positions(_emitted(verify, P, DRAFTS, 6000))
    assert len(pvalues) >= 2 and min(pvalues) > 1e-3, pvalues


def test_the_test_fails_when_the_acceptance_rule_is_broken():
    """Accepting every draft (no rejection) and a residual that keeps the rejected draft both change the output
    distribution: the same chi-square test rejects them."""

    def always_accept(logits, drafts, params, sampler, g):
        return verify(logits, drafts, params.__class__(temperature=1.0), sampler, g).__class__(
            list(drafts) + [int(torch.multinomial(logits[len(drafts)].softmax(-1), 1, generator=g))]
        )

    def residual_keeps_draft(logits, drafts, params, sampler, g):
        probs = logits.softmax(-1)
        for j, x in enumerate(drafts):
            if float(torch.rand(1, generator=g)) < float(probs[j, x]):
                continue
            return verify.__globals__["Verdict"](list(drafts[:j]) + [int(torch.multinomial(probs[j], 1, generator=g))])
        return verify.__globals__["Verdict"](list(drafts) + [int(torch.multinomial(probs[-1], 1, generator=g))])

    for broken in (always_accept, residual_keeps_draft):
        assert min(_chi2_positions(_emitted(broken, P, DRAFTS, 6000))) < 1e-6


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    out = verify(logits, [1, 2], SamplingParams(temperature=0.0), Sampler(), None)
    assert out.tokens == [1, 0] and out.accepted_drafts == 1  # second draft wrong: the target's own
    assert verify(logits, [1, 0], SamplingParams(temperature=0.0), Sampler(), None).tokens == [1, 0, 2]


# ------------------------------------------------------------------------------------------------ in the engine
@pytest.fixture(scope="module")
def repetitive():
    """A tiny random llama whose greedy text repeats itself (so prompt lookup finds drafts), and copy-heavy prompts."""
    cfg = tiny_config("llama")
    model = model_from_state(cfg, random_state(cfg, seed=3))
    g = torch.Generator().manual_seed(0)
    base = [torch.randint(0, cfg.vocab_size, (12,), generator=g).tolist() for _ in range(6)]
    return model, [b + b[:8] for b in base]


def _llm(model, spec=None, **kw):
    return LLM(loaded=(model, None), num_blocks=96, block_size=4, speculative_config=spec, **kw)


@pytest.mark.parametrize("weights", [None, "int8"])
def test_greedy_output_equals_decoding_without_speculation(repetitive, weights):
    model, prompts = repetitive
    if weights:
        from bytediet.models.quantize import QuantizeConfig, quantize

        model = model_from_state(model.config, random_state(model.config, seed=3))
        quantize(model, QuantizeConfig(weights))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    plain = _llm(model).generate(prompts, params)
    spec = _llm(model, NGRAM)
    fast = spec.generate(prompts, params)
    stats_ = spec.engine.stats
    assert stats_.spec_verifications > 0 and stats_.spec_accepted_tokens > 0, "drafts must be proposed and kept"
    for a, b in zip(fast, plain):
        assert_same_or_tie(a.outputs[0].token_ids, b.outputs[0])
        assert len(a.outputs[0].logprobs) == len(a.outputs[0].token_ids) == 24
    assert spec.engine.num_free_blocks == spec.engine.block_manager.num_blocks


def test_a_lone_sequence_times_its_verifying_steps(repetitive):
    model, prompts = repetitive
    llm = _llm(model, NGRAM)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert any(rows > 1 for rows in llm.engine.verify_costs.rows_timed)
    assert _llm(model).engine.verify_costs.rows_timed == []  # without speculation nothing is timed


def test_rejected_drafts_give_their_blocks_back_at_every_step(repetitive):
    model, prompts = repetitive
    llm = _llm(model, {**NGRAM, "num_speculative_tokens": 8})
    engine = llm.engine
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_unfinished_requests():
        engine.step()
        bm = engine.block_manager
        for r in engine.scheduler.running:
            assert len(r.block_ids) == -(-r.num_computed_tokens // bm.block_size), r
        held = sum(len(r.block_ids) for r in engine.scheduler.running)
        shared = sum(b.ref_count for b in bm.blocks)
        assert shared == held
    assert engine.stats.spec_draft_tokens > engine.stats.spec_accepted_tokens > 0  # some drafts were rejected
    assert engine.num_free_blocks == engine.block_manager.num_blocks


def test_max_tokens_stop_strings_and_prefix_cache_hold(repetitive):
    model, prompts = repetitive
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)
    plain = _llm(model).generate(prompts, params)
    llm = _llm(model, NGRAM)
    fast = llm.generate(prompts, params)
    for a, b in zip(fast, plain):
        assert len(a.outputs[0].token_ids) == 13
        assert_same_or_tie(a.outputs[0].token_ids, b.outputs[0])
    again = llm.generate(prompts[:1], params)[0]  # the prompt's blocks come from the prefix cache
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == fast[0].outputs[0].token_ids
    stop = [t for t in fast[0].outputs[0].token_ids[5:7]]
    stopped = llm.generate(
        prompts[:1], SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True, stop_token_ids=tuple(stop[:1]))
    )[0].outputs[0]
    plain_stopped = (
        _llm(model)
        .generate(
            prompts[:1], SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True, stop_token_ids=tuple(stop[:1]))
        )[0]
        .outputs[0]
    )
    assert stopped.token_ids == plain_stopped.token_ids and stopped.finish_reason == "stop"


def test_requests_with_penalties_do_not_speculate(repetitive):
    model, prompts = repetitive
    llm = _llm(model, NGRAM)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3))
    assert llm.engine.stats.spec_verifications == 0


@pytest.fixture(scope="module")
def draft_pair(tmp_path_factory):
    """Two tiny llama checkpoints with one tokenizer and different random weights, and one with another tokenizer."""
    from safetensors.torch import save_file

    from tests.eval.test_harness import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("draft-pair")
    target = write_tiny_checkpoint(root / "target", seed=0)
    draft = write_tiny_checkpoint(root / "draft", seed=0)
    config = tiny_config("llama", vocab_size=300, max_position_embeddings=512)
    state = random_state(model_from_state(config, random_state(config, 0)).config, seed=9)
    save_file({k: v.contiguous() for k, v in state.items()}, str(draft / "model.safetensors"))
    other = write_tiny_checkpoint(root / "other", seed=5)
    return target, draft, other


def test_a_draft_model_keeps_greedy_output_exact(draft_pair):
    target, draft, _ = draft_pair
    prompts = ["the cat sat on the mat and the cat sat", "a b c a b c a b"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    plain = LLM(str(target), num_blocks=64, block_size=4).generate(prompts, params)
    for drafter in (str(target), str(draft)):  # a perfect draft (the target itself) and a poor one
        llm = LLM(
            str(target),
            num_blocks=64,
            block_size=4,
            speculative_config={"method": "draft_model", "model": drafter, "num_speculative_tokens": 3},
        )
        out = llm.generate(prompts, params)
        for a, b in zip(out, plain):
            assert_same_or_tie(a.outputs[0].token_ids, b.outputs[0])
        assert llm.engine.stats.spec_draft_tokens > 0
        if drafter == str(target):
            assert llm.engine.stats.spec_accepted_tokens > 0.8 * llm.engine.stats.spec_draft_tokens
        assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_a_draft_model_with_another_tokenizer_is_refused(draft_pair):
    target, _, other = draft_pair
    with pytest.raises(ConfigError, match="another tokenizer"):
        LLM(
            str(target),
            num_blocks=16,
            block_size=4,
            speculative_config={"method": "draft_model", "model": str(other), "num_speculative_tokens": 2},
        )


def test_a_kv_codec_with_per_sequence_staging_is_refused_with_speculation(repetitive):
    model, _ = repetitive
    with pytest.raises(ConfigError, match="kivi2.*--kv-cache-dtype"):
        LLM(loaded=(model, None), num_blocks=64, block_size=32, kv_cache_dtype="kivi2", speculative_config=NGRAM)
