"""The engine flags shared by generate / serve / bench / eval / quantize: the KV tiers' flags and their policy's
roofline seed, ``--device`` resolved (and refused in one line without a GPU)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from unittest import mock

import pytest
import torch

from bytediet.commands._engine_args import (
    add_model_args,
    offload_kwargs,
    resolved_device,
    seed_speculation_limit,
    seed_tier_policy,
)
from bytediet.engine.llm import LLM
from bytediet.errors import BytedietError
from bytediet.perf.bench import ModelWeightBits
from bytediet.perf.hardware import get_hardware
from bytediet.perf.roofline import memory_bound_batch
from tests.conftest import model_from_state, random_state, tiny_config


def tiny_llm(**engine) -> LLM:
    """A tiny random llama in a 16-block pool of 4-token blocks, with these LLM(...) keywords."""
    config = tiny_config("llama")
    return LLM(loaded=(model_from_state(config, random_state(config)), None), num_blocks=16, block_size=4, **engine)


def tiered_llm() -> LLM:
    return tiny_llm(kv_offload_size="1MiB")


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


def speculating_llm(**spec) -> LLM:
    return tiny_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4, **spec})


def test_speculation_stops_where_the_roofline_says_the_verifying_step_turns_compute_bound():
    llm = speculating_llm()
    hardware = get_hardware("h100-sxm")
    sequences = memory_bound_batch(
        llm.model.config, hardware, weights=ModelWeightBits(llm.model), kv=llm.engine.runner.codec, decode_rows=5
    )
    assert llm.engine.spec_batch_limit.source == "default"
    with mock.patch("bytediet.perf.measure.this_machine", return_value=hardware):
        seed_speculation_limit(llm)
    limit = llm.engine.spec_batch_limit
    assert (limit.source, limit.sequences, limit.rows) == ("roofline", sequences, 5 * sequences)
    pinned = speculating_llm(disable_by_batch_size=3)  # the user's limit stands
    with mock.patch("bytediet.perf.measure.this_machine", return_value=hardware):
        seed_speculation_limit(pinned)
    assert (pinned.engine.spec_batch_limit.sequences, pinned.engine.spec_batch_limit.source) == (3, "config")
    fresh = speculating_llm()
    with mock.patch("bytediet.perf.measure.this_machine", side_effect=BytedietError("not measured")):
        seed_speculation_limit(fresh)  # an unmeasured machine: the default stands, no error
    assert fresh.engine.spec_batch_limit.source == "default"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no GPU")
@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "--tasks", "ppl"],
        ["eval", "--kv-pareto"],
        ["eval", "-tp", "2"],
        ["quantize", "--format", "int8", "--out", "{tmp}/never-written"],
    ],
    ids=["eval", "eval-kv-pareto", "eval-tp", "quantize"],
)
def test_device_cuda_without_a_gpu_is_refused_in_one_line(argv, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "bytediet.cli", *(a.format(tmp=tmp_path) for a in argv), "--device", "cuda", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "--device cuda" in r.stderr
    assert not (tmp_path / "never-written").exists()


def test_resolved_device_wants_a_gpu_per_tensor_parallel_rank(monkeypatch):
    """auto: CUDA where torch sees GPUs (one per rank), else the CPU ranks; cuda with too few GPUs: one line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolved_device("cpu") == "cpu" and resolved_device("auto", tensor_parallel_size=2) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolved_device("auto", tensor_parallel_size=2) == "cuda"
    assert resolved_device("cuda", tensor_parallel_size=2) == "cuda"
    assert resolved_device("cpu", tensor_parallel_size=4) == "cpu"
    with pytest.raises(BytedietError, match="--tensor-parallel-size 4 on CUDA needs a GPU per rank, and torch sees 2"):
        resolved_device("auto", tensor_parallel_size=4)
