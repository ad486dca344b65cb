"""``evaluate`` at tensor-parallel size 2 (one spawned gloo worker) against size 1 on a tiny checkpoint."""

from __future__ import annotations

import multiprocessing

import pytest

from bytediet.errors import ConfigError
from bytediet.eval.harness import EvalSettings, evaluate
from tests.eval.test_harness import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tp"), seed=4)


def settings(ckpt, tasks=("ppl",)) -> EvalSettings:
    return EvalSettings(
        corpus=str(ckpt / "corpus.txt"),
        windows=2,
        window_len=40,
        tasks=tasks,
        seed=1,
        passkey_lengths=(260,),
        passkey_depths=(0.5,),
        speed_new_tokens=4,
        speed_prompt_len=16,
    )


def tp_ranks_alive() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("bytediet-tp-rank")]


def test_every_task_at_tp2_equals_tp1_on_the_same_ranks(ckpt):
    """No weight format: the reference's ranks also serve the test (its KV codec); perplexity, KL and the
    passkey answers are size 1's, speed counts the weights and memory of both processes."""
    s = settings(ckpt, tasks=("ppl", "passkey", "speed"))
    one = evaluate(str(ckpt), kv_cache_dtype="int8", settings=s, progress=False)
    two = evaluate(str(ckpt), kv_cache_dtype="int8", settings=s, progress=False, tensor_parallel_size=2)
    assert not tp_ranks_alive()
    assert two["tensor_parallel_size"] == 2 and two["config"] == one["config"]
    a, b = one["tasks"]["ppl"], two["tasks"]["ppl"]
    for side in ("reference", "test"):
        assert b[side]["ppl"] == pytest.approx(a[side]["ppl"], rel=1e-5)
        assert b[side]["tokens"] == a[side]["tokens"]
    assert b["kl"]["mean"] == pytest.approx(a["kl"]["mean"], rel=1e-3, abs=1e-9)
    assert b["top1_agreement"] == a["top1_agreement"]
    answers = lambda r: [x["answer"] for x in r["tasks"]["passkey"]["test"]["answers"]]
    assert answers(two) == answers(one)
    speed_one, speed_two = one["tasks"]["speed"]["test"], two["tasks"]["speed"]["test"]
    assert speed_two["processes"] == 2 and speed_one["processes"] == 1
    assert speed_two["kv_bytes_per_token"] == speed_one["kv_bytes_per_token"]  # every rank's heads together
    # each rank holds its slices; the norms are replicated, so both ranks together hold a little more
    assert speed_one["weight_bytes"] <= speed_two["weight_bytes"] < 1.05 * speed_one["weight_bytes"]
    assert speed_two["new_tokens"] == 4


def test_a_weight_format_reloads_the_ranks_and_matches_tp1(ckpt):
    s = settings(ckpt)
    one = evaluate(str(ckpt), weights="int8", settings=s, progress=False)["tasks"]["ppl"]
    two = evaluate(str(ckpt), weights="int8", settings=s, progress=False, tensor_parallel_size=2)["tasks"]["ppl"]
    assert not tp_ranks_alive()
    assert two["reference"]["ppl"] == pytest.approx(one["reference"]["ppl"], rel=1e-5)
    # int8 layers quantize their activations per row: a row-parallel rank's slice of the row may round apart
    assert two["test"]["ppl"] == pytest.approx(one["test"]["ppl"], rel=1e-4)


@pytest.mark.parametrize(
    "kv, calibration",
    [("turboquant3.5", {"corpus": "x", "windows": 1, "window_len": 32, "seed": 0}), ("auto:4.5", None)],
)
def test_kv_calibration_is_refused_before_anything_loads(ckpt, kv, calibration):
    with pytest.raises(ConfigError, match="KV calibration .* not at --tensor-parallel-size 2"):
        evaluate(
            str(ckpt),
            kv_cache_dtype=kv,
            settings=settings(ckpt),
            progress=False,
            kv_calibration=calibration,
            tensor_parallel_size=2,
        )
    assert not tp_ranks_alive()
