"""``bench --parts speculative``: its prompts, and a tiny end-to-end run on the default model."""

from __future__ import annotations

import json
import subprocess
import sys

from bytediet.perf import speculative_bench
from bytediet.perf.speculative_bench import copy_prompts, measure_interleaved

TEXT = "\n\n".join(" ".join(f"word{i}x{j} Anne" for j in range(100)) for i in range(5))
MANY = "\n\n".join(" ".join(f"word{i}x{j} Anne" for j in range(100)) for i in range(12))


def test_copy_prompts_hold_the_passages_and_open_prompts_hold_none():
    p = copy_prompts(TEXT, seed=1, per_task=1)
    assert set(p) == {"spelling", "names", "quote", "open"}
    assert "word" in p["names"][0] and "Smith" in p["names"][0]
    assert p["spelling"][0] != p["names"][0] and all("word" not in m for m in p["open"])


def test_bench_speculative_part_runs_and_prints_one_json_object():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bytediet.cli",
            "bench",
            "--parts",
            "speculative",
            "--quick",
            "--peers",
            "none",
            "--threads",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data["systems"]) == {"bytediet", "bytediet+spec"} and data["speculative_config"]["method"] == "ngram"
    assert data["prompt_format"] == "chat template"
    for task in ("spelling", "names", "quote", "open"):
        assert data["systems"]["bytediet"][task]["decode_tokens_per_s"] > 0
        assert data["ratios"]["bytediet"][task] > 0


def test_a_model_without_a_chat_template_reads_the_message_as_plain_text():
    class Tokenizer:
        chat_template = None

    class FakeLLM:
        tokenizer = Tokenizer()

        def encode(self, text):
            return [len(text)]

        def chat_token_ids(self, messages):
            return [0, len(messages[0]["content"]), 1]

    llm = FakeLLM()
    assert speculative_bench.prompt_token_ids(llm, "Emma") == [4]
    llm.tokenizer.chat_template = "{{ messages }}"
    assert speculative_bench.prompt_token_ids(llm, "Emma") == [0, 4, 1]


def test_copy_prompts_give_distinct_passages_per_task():
    p = copy_prompts(MANY, seed=2, per_task=3)
    assert [len(p[t]) for t in ("spelling", "names", "quote", "open")] == [3, 3, 3, 3]
    bodies = [m.split("\n\n", 1)[1][:40] for t in ("names", "quote") for m in p[t]]
    assert len(set(bodies)) == 6


class FakeDecoder:
    def __init__(self, name, rate, log, spec=None):
        self.name, self.rate, self.log, self.spec = name, rate, log, spec

    def decode(self, ids, max_tokens):
        self.log.append((self.name, tuple(ids), max_tokens))
        return self.rate * (1 + ids[0]), self.spec


def test_interleaved_runs_every_prompt_on_every_system_in_rotated_order():
    log = []
    systems = [FakeDecoder("a", 10.0, log), FakeDecoder("b", 20.0, log, spec=(4, 3, 2))]
    prompts = {"copy": [[0], [1], [2]], "open": [[0]]}
    out = measure_interleaved(systems, prompts, 8, rounds=2)
    runs = [entry for entry in log if entry[2] == 8]
    assert [name for name, *_ in runs[:2]] == ["a", "b"]  # round 1: a then b on the first prompt
    assert [name for name, *_ in runs[8:10]] == ["b", "a"]  # round 2 rotated
    assert out["a"]["copy"]["runs"] == 6 and out["a"]["copy"]["decode_tokens_per_s"] == 20.0  # median of 10,20,30
    assert out["b"]["copy"]["acceptance_rate"] == 0.75 and out["b"]["copy"]["mean_tokens_per_verification"] == 2.5
    assert "acceptance_rate" not in out["a"]["open"]


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def test_replay_of_an_output_that_copies_its_prompt_reaches_k_plus_one_tokens_a_step():
    """An output equal to a span of the prompt after a 4-token match: every step keeps its k drafts and adds its own
    token, 20 tokens in 4 steps — the ceiling is k + 1 = 5 tokens a step."""
    prompt = [1, 2, 3, 4] + list(range(10, 40)) + [1, 2, 3, 4]
    output = list(range(10, 30))  # 20 tokens, copied from the prompt
    assert speculative_bench.replay_lookup(prompt, output, SPEC) == 20 / 4


def test_replay_of_an_output_with_nothing_to_copy_is_plain_decoding():
    prompt, output = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]
    assert speculative_bench.replay_lookup(prompt, output, SPEC) == 1.0
    assert speculative_bench.replay_lookup(prompt, output, SPEC, row_cost=0.3) == 1.0


def test_replay_at_a_row_cost_charges_the_drafts_and_never_beats_the_ceiling():
    prompt = [1, 2, 3, 4] + list(range(10, 40)) + [1, 2, 3, 4]
    output = list(range(10, 22)) + [99, 98, 97, 96] + list(range(22, 30))
    free, dear = (speculative_bench.replay_lookup(prompt, output, SPEC, c) for c in (None, 0.1))
    assert 1.0 < dear < free


def test_lookup_ceilings_summarise_each_task_from_the_plain_outputs():
    prompts = {"copy": [[1, 2, 3, 4] + list(range(10, 40)) + [1, 2, 3, 4]], "open": [[5, 6, 7]]}
    outputs = {tuple(prompts["copy"][0]): list(range(10, 30)), (5, 6, 7): [8, 9, 10]}
    got = speculative_bench.lookup_ceilings(prompts, outputs, SPEC, 0.1)
    assert got["copy"]["ceiling"] == 5.0 and got["open"]["ceiling"] == 1.0
    assert 1.0 < got["copy"]["predicted"] < 5.0 and got["copy"]["row_cost"] == 0.1
