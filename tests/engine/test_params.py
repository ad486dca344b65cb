"""SamplingParams: vLLM defaults, validation that names the field, serialisation round trip."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bytediet.engine.params import SamplingParams
from bytediet.errors import ConfigError


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 16, 1.0, -1, 1.0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.stop == () and p.stop_token_ids == () and p.logprobs is None
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.skip_special_tokens
    assert not p.greedy and not p.has_penalties


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("max_tokens", 0, ">= 1"),
        ("max_tokens", -3, ">= 1"),
        ("max_tokens", 2.5, ">= 1"),
        ("temperature", -0.1, ">= 0"),
        ("temperature", math.nan, ">= 0"),
        ("temperature", math.inf, ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.01, "(0, 1]"),
        ("top_p", -0.5, "(0, 1]"),
        ("min_p", -0.01, "[0, 1]"),
        ("min_p", 1.5, "[0, 1]"),
        ("top_k", -2, "-1 / 0"),
        ("top_k", 3.0, "-1 / 0"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", -1.0, "> 0"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -2.5, "[-2, 2]"),
        ("n", 0, ">= 1"),
        ("n", True, ">= 1"),
        ("logprobs", -1, ">= 0"),
        ("seed", 1.5, "integer"),
        ("stop", [""], "non-empty"),
        ("stop", ["ok", 3], "non-empty"),
        ("stop_token_ids", [-1], ">= 0"),
        ("stop_token_ids", ["2"], ">= 0"),
        ("ignore_eos", "yes", "true or false"),
    ],
)
def test_every_invalid_value_names_its_field_and_range(field, value, allowed):
    with pytest.raises(ConfigError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert message.startswith(field) and allowed in message, message


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 0.0),
        ("top_p", 1.0),
        ("top_p", 1e-6),
        ("min_p", 0.0),
        ("min_p", 1.0),
        ("top_k", -1),
        ("top_k", 0),
        ("top_k", 1),
        ("max_tokens", None),
        ("max_tokens", 1),
        ("logprobs", 0),
        ("seed", -7),
        ("presence_penalty", -2.0),
        ("frequency_penalty", 2.0),
        ("repetition_penalty", 1e-3),
    ],
)
def test_boundary_values_are_accepted(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_validate_checks_token_ids_against_the_vocabulary():
    SamplingParams(stop_token_ids=[0, 99], logprobs=100).validate(vocab_size=100)
    with pytest.raises(ConfigError, match=r"^stop_token_ids: token id 100 .*\[0, 99\]"):
        SamplingParams(stop_token_ids=[5, 100]).validate(vocab_size=100)
    with pytest.raises(ConfigError, match=r"^logprobs .*\[0, 100\]"):
        SamplingParams(logprobs=101).validate(vocab_size=100)


def test_a_single_stop_string_and_ints_are_normalised():
    p = SamplingParams(stop="###", temperature=0, top_p=1)
    assert p.stop == ("###",)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert p.greedy


def test_completion_seeds_follow_vllm():
    p = SamplingParams(n=3, seed=10)
    assert [p.for_completion(i).seed for i in range(3)] == [10, 11, 12]
    assert all(p.for_completion(i).n == 1 for i in range(3))
    assert p.generator_seed(2) == 12 and SamplingParams().generator_seed(1) is None
    assert SamplingParams(seed=-1).generator_seed() == 2**64 - 1  # torch seeds are unsigned 64-bit


def test_from_dict_rejects_unknown_fields_by_name():
    with pytest.raises(ConfigError, match="unknown sampling field.*top_q"):
        SamplingParams.from_dict({"top_q": 0.5})


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 4),
    max_tokens=st.one_of(st.none(), st.integers(1, 4096)),
    temperature=st.floats(0, 5),
    top_k=st.integers(-1, 100),
    top_p=st.floats(1e-3, 1.0),
    min_p=st.floats(0, 1),
    penalties=st.tuples(st.floats(0.1, 3), st.floats(-2, 2), st.floats(-2, 2)),
    seed=st.one_of(st.none(), st.integers(0, 2**63)),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 1000), max_size=3),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
    flags=st.tuples(st.booleans(), st.booleans(), st.booleans()),
)
def test_to_dict_from_dict_round_trip(
    n, max_tokens, temperature, top_k, top_p, min_p, penalties, seed, stop, stop_token_ids, logprobs, flags
):
    p = SamplingParams(
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=penalties[0],
        presence_penalty=penalties[1],
        frequency_penalty=penalties[2],
        seed=seed,
        stop=stop,
        stop_token_ids=stop_token_ids,
        logprobs=logprobs,
        ignore_eos=flags[0],
        include_stop_str_in_output=flags[1],
        skip_special_tokens=flags[2],
    )
    d = p.to_dict()
    assert d["stop"] == list(stop) and d["stop_token_ids"] == list(stop_token_ids)
    assert SamplingParams.from_dict(d) == p
