"""The memory plans of ``eval``, ``quantize`` and ``serve``: printed, in ``--json``, and a machine too small refused
in one line before anything is loaded."""

from __future__ import annotations

import json

import pytest

from bytediet.cli import main
from bytediet.commands._memory import plan_eval, plan_kv_pareto, plan_quantize, plan_serve
from bytediet.perf import memory
from tests.eval.test_harness import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-memory"), seed=3)


@pytest.fixture
def small_machine(monkeypatch):
    """A machine with 1 kB available; loading anything fails the test."""
    from bytediet.models import loader

    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    monkeypatch.setattr(memory, "rss_bytes", lambda: 1000)
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded before the memory check"))


def commands(ckpt, tmp_path):
    corpus = str(ckpt / "corpus.txt")
    return {
        "eval": ["eval", "--model", str(ckpt), "--corpus", corpus, "--windows", "4", "--window-len", "40"],
        "quantize": ["quantize", "--model", str(ckpt), "--format", "int8", "--out", str(tmp_path / "q")],
        "serve": ["serve", "--model", str(ckpt), "--port", "0", "--device", "cpu"],
    }


@pytest.mark.parametrize(
    "command, fix",
    [("eval", "fewer windows: --windows 2"), ("quantize", "more memory"), ("serve", "--kv-cache-memory")],
)
def test_a_machine_too_small_is_refused_before_loading(ckpt, tmp_path, capsys, small_machine, command, fix):
    assert main(commands(ckpt, tmp_path)[command] + ["--no-progress"] * (command != "serve")) == 2
    err = capsys.readouterr().err
    assert f"bytediet {command}: predicted peak memory" in err
    line = [x for x in err.splitlines() if "needs about" in x]
    assert len(line) == 1 and "this machine has 0.0 GB available" in line[0] and fix in line[0]
    assert not (tmp_path / "q").exists()


def test_the_plans_grow_with_what_the_options_hold(ckpt):
    small, big = plan_eval(str(ckpt), windows=1, window_len=64), plan_eval(str(ckpt), windows=8, window_len=128)
    assert big.parts["reference logits"] > small.parts["reference logits"] > 0
    assert plan_eval(str(ckpt), "int8").parts["test model (int8)"] > 0
    rtn, gptq = plan_quantize(str(ckpt), "int4-g32"), plan_quantize(str(ckpt), "int4-g32", "gptq", 64, 512)
    assert gptq.parts["building"] > rtn.parts["building"] and rtn.parts["model (float32)"] > 0
    assert plan_serve(str(ckpt), kv_cache_memory="2GiB").total - plan_serve(str(ckpt)).total == 1 << 30


def test_kv_pareto_plan_holds_at_most_the_caches_ram_of_reference_logits(ckpt, monkeypatch):
    """Windows beyond the cache's RAM go to files: the reference logits stop growing with the windows."""
    from bytediet.eval import harness

    cfg = plan_kv_pareto(str(ckpt)).parts
    one, four = plan_kv_pareto(str(ckpt), windows=1, window_len=65), plan_kv_pareto(str(ckpt), windows=4, window_len=65)
    window = 64 * memory.footprint(str(ckpt)).config.vocab_size * 4  # 64 predicted rows of float32 logits
    assert four.parts["reference logits"] == 4 * one.parts["reference logits"] == 4 * window > 0
    monkeypatch.setattr(harness, "REFERENCE_RAM_BYTES", int(2.5 * window))  # two whole windows fit
    assert plan_kv_pareto(str(ckpt), windows=8, window_len=65).parts["reference logits"] == 2 * window
    assert cfg["passkey engine KV (bf16)"] == 0 and cfg["KV calibration (captured K, V, Q)"] > 0
    skipped = plan_kv_pareto(str(ckpt), passkey_lengths=(1 << 20,))  # beyond the context: not run, not counted
    assert skipped.parts["passkey engine KV (bf16)"] == 0
    assert plan_kv_pareto(str(ckpt), passkey_lengths=(200,)).parts["passkey engine KV (bf16)"] > 0


def test_kv_pareto_on_a_machine_too_small_is_refused_before_loading(ckpt, tmp_path, capsys, small_machine):
    assert main(commands(ckpt, tmp_path)["eval"] + ["--kv-pareto", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "bytediet eval --kv-pareto: predicted peak memory" in err
    assert len([x for x in err.splitlines() if "needs about" in x]) == 1


def test_quantize_json_carries_the_plan_and_the_measured_peak(ckpt, tmp_path, capsys):
    argv = commands(ckpt, tmp_path)["quantize"] + ["--no-progress", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    mem = json.loads(out)["memory"]
    assert mem["predicted_peak_bytes"] == sum(mem["parts"].values()) and mem["measured_peak_bytes"] > 0
    assert "bytediet quantize: predicted peak memory" in err
