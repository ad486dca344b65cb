"""``bench --parts speculative``: its prompts, and a tiny end-to-end run on the default model."""

from __future__ import annotations

import json
import subprocess
import sys

from bytediet.perf.speculative_bench import copy_prompts

TEXT = "\n\n".join(" ".join(f"word{i}x{j} Anne" for j in range(100)) for i in range(5))


def test_copy_prompts_hold_the_passages_and_open_prompts_hold_none():
    p = copy_prompts(TEXT, seed=1)
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
    for task in ("spelling", "names", "quote", "open"):
        assert data["systems"]["bytediet"][task]["decode_tokens_per_s"] > 0
        assert data["ratios"]["bytediet"][task] > 0
