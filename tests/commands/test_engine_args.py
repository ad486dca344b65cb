"""The engine flags shared by generate / serve / bench: the KV tiers' flags and their policy's roofline seed."""

from __future__ import annotations

import argparse
from unittest import mock

from bytediet.commands._engine_args import (
    add_model_args,
    offload_kwargs,
    seed_tier_policy,
)
from bytediet.engine.llm import LLM
from bytediet.errors import BytedietError
from bytediet.perf.hardware import get_hardware
from tests.conftest import model_from_state, random_state, tiny_config


def tiered_llm() -> LLM:
    config = tiny_config("llama")
    return LLM(
        loaded=(model_from_state(config, random_state(config)), None),
        num_blocks=16,
        block_size=4,
        kv_offload_size="1MiB",
    )


def test_offload_flags_become_llm_keywords():
    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args(["--kv-offload-size", "4GiB", "--kv-offload-dir", "/tmp/x", "--kv-offload-codec", "rot-q8_0"])
    assert offload_kwargs(args) == {
        "kv_offload_dir": "/tmp/x",
        "kv_offload_size": "4GiB",
        "kv_offload_disk_size": "40GiB",
        "kv_offload_codec": "rot-q8_0",
    }
    assert offload_kwargs(p.parse_args([]))["kv_offload_size"] == "0"


def test_the_policy_is_seeded_with_the_roofline_prefill_time_until_one_is_measured():
    llm = tiered_llm()
    hardware = get_hardware("h100-sxm")
    with mock.patch("bytediet.perf.measure.this_machine", return_value=hardware):
        seed_tier_policy(llm)
    seeded = llm.engine.tiers.seconds_per_token
    assert seeded is not None and 0 < seeded < 1e-3
    llm.engine.tiers.observe_prefill(100, 1.0)
    assert llm.engine.tiers.seconds_per_token != seeded  # measurements take over
    fresh = tiered_llm()
    with mock.patch("bytediet.perf.measure.this_machine", side_effect=BytedietError("not measured")):
        seed_tier_policy(fresh)  # an unmeasured machine: nothing to seed, no error
    assert fresh.engine.tiers.seconds_per_token is None
