"""``EngineInfo.validate`` (the API process's checks) agrees with ``LLMEngine.validate``; counters follow the engine."""

from __future__ import annotations

import pickle

import pytest

from bytediet.engine.params import SamplingParams
from bytediet.engine.snapshot import engine_counters, engine_info
from bytediet.errors import ConfigError
from tests.server.conftest import tiny_llm


@pytest.fixture(scope="module")
def engine():
    return tiny_llm(context=64, num_blocks=8, block_size=4).engine  # 32 KV tokens < the 64-token context


@pytest.mark.parametrize(
    "ids,params",
    [
        ([], SamplingParams()),
        ([3, 96], SamplingParams()),
        ([-1], SamplingParams()),
        ([3] * 40, SamplingParams()),
        ([3] * 64, SamplingParams()),
        ([3], SamplingParams(n=2)),
        ([3], "not params"),
    ],
)
def test_bad_input_fails_alike(engine, ids, params):
    with pytest.raises(ConfigError) as here:
        engine.validate(ids, params)
    with pytest.raises(ConfigError) as there:
        engine_info(engine).validate(ids, params)
    assert str(there.value) == str(here.value)


def test_good_input_passes_alike(engine):
    params = SamplingParams(max_tokens=3)
    assert engine_info(engine).validate((5, 6, 7), params) == engine.validate((5, 6, 7), params) == [5, 6, 7]


def test_info_and_counters_cross_a_pipe(engine):
    info = pickle.loads(pickle.dumps(engine_info(engine)))
    assert (info.vocab_size, info.num_blocks, info.block_size, info.capacity) == (96, 8, 4, 32)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), request_id="a")
    engine.step()
    c = pickle.loads(pickle.dumps(engine_counters(engine)))
    assert c.num_running == 1 and c.num_free_blocks < 8 and c.failure is None
    while engine.has_unfinished_requests():
        engine.step()
    assert engine_counters(engine).num_free_blocks == 8
