"""``bytediet generate`` and ``chat`` on the real default model, end to end in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "bytediet.cli"]


def test_generate_json_prints_exactly_one_object():
    r = subprocess.run(
        CLI + ["generate", "--prompt", "The capital of France is", "--max-tokens", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["generated_tokens"] == len(data["completion_token_ids"]) == 4 or data["finish_reason"] == "stop"
    assert data["prompt_token_ids"] and data["finish_reason"] in ("stop", "length")
    assert data["achieved_weight_gb_per_s"] > 0 and 0 < data["fraction_of_read_bandwidth"]


def test_generate_json_says_which_codec_and_block_size_ran():
    # kivi2's 32-token key groups: the default block size grows to 32 instead of failing at 16
    r = subprocess.run(
        CLI
        + [
            "generate",
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "2",
            "--json",
            "--kv-cache-dtype",
            "kivi2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["kv_cache_dtype"].startswith("kivi2 (k: kivi2-keys-g32") and data["block_size"] == 32
    assert data["weights"]


def test_generate_speculates_with_prompt_lookup_and_reports_it():
    prompt = "one two three four five six one two three four five six one two three"
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}'
    base = CLI + ["generate", "--prompt", prompt, "--max-tokens", "12", "--json", "--ignore-eos"]
    r = subprocess.run(base + ["--speculative-config", spec], capture_output=True, text=True, timeout=300)
    plain = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and plain.returncode == 0, r.stderr + plain.stderr
    data, want = json.loads(r.stdout), json.loads(plain.stdout)
    assert data["completion_token_ids"] == want["completion_token_ids"]  # greedy: the same text
    s = data["speculative"]
    assert s["method"] == "ngram" and s["draft_tokens"] > 0 and 0 <= s["accepted_tokens"] <= s["draft_tokens"]
    bad = subprocess.run(
        base + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 20}'],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "num_speculative_tokens" in bad.stderr and "Traceback" not in bad.stderr


def test_generate_rejects_bad_sampling_values_with_exit_code_2():
    r = subprocess.run(
        CLI + ["generate", "--prompt", "hi", "--top-p", "1.5"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2 and "top_p" in r.stderr and "Traceback" not in r.stderr


def test_chat_answers_each_turn_until_exit():
    r = subprocess.run(
        CLI + ["chat", "--max-tokens", "6"],
        input="Hello!\nWhat is 2+2?\n/exit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("assistant> ") == 2


def test_generate_accepts_a_run_config(tmp_path):
    cfg = tmp_path / "run.json"
    cfg.write_text(
        json.dumps(
            {
                "bytediet_run_config": 1,
                "model": "default",
                "weights": "int8",
                "kv_cache_dtype": "int8",
                "engine": {"kv_cache_memory": "256MiB"},
            }
        )
    )
    r = subprocess.run(
        CLI + ["generate", "--config", str(cfg), "--prompt", "Paris is", "--max-tokens", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["weight_bytes"] < 300e6  # int8 linear layers, not the 538 MB fp32 model


@pytest.mark.slow  # three Python processes start (CLI, its worker, this one's model): ~30 s on two cores
def test_generate_with_tensor_parallel_size_2_matches_one_process(tmp_path):
    """``--tensor-parallel-size 2`` through the CLI (one spawned gloo worker) on a tiny checkpoint."""
    from bytediet.engine.llm import LLM
    from bytediet.engine.params import SamplingParams
    from tests.distributed.conftest import write_hf_checkpoint

    write_hf_checkpoint(tmp_path / "tiny", "llama", seed=5)
    r = subprocess.run(
        CLI
        + [
            "generate",
            "--model",
            str(tmp_path / "tiny"),
            "--prompt",
            "w3 w5 w8 w13",
            "--max-tokens",
            "8",
            "--ignore-eos",
            "--weights",
            "fp32",
            "--tensor-parallel-size",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    one = (
        LLM(str(tmp_path / "tiny"), weights="fp32")
        .generate(data["prompt_token_ids"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
        .outputs[0]
    )
    assert data["completion_token_ids"] == one.token_ids
    assert "tensor parallel" in json.dumps(data)  # the decode path it reports


def test_generate_finds_its_prompt_on_disk_after_a_restart_and_says_so(tmp_path):
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    flags = ["generate", "--prompt", prompt, "--max-tokens", "3", "--json", "--kv-offload-dir", str(tmp_path)]
    runs = [subprocess.run(CLI + flags, capture_output=True, text=True, timeout=300) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr + runs[1].stderr
    cold, warm = (json.loads(r.stdout) for r in runs)
    assert cold["cached_prompt_tokens"] == {"pool": 0}
    assert warm["cached_prompt_tokens"]["disk"] == 16 * ((len(warm["prompt_token_ids"]) - 1) // 16)
    assert warm["completion_token_ids"] == cold["completion_token_ids"]


def test_generate_rejects_an_offload_size_below_one_block_in_one_line():
    r = subprocess.run(
        CLI + ["generate", "--prompt", "hi", "--kv-offload-size", "1KiB"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2 and "below one block" in r.stderr and len(r.stderr.strip().splitlines()) == 1
