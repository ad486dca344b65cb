"""``bytediet recover`` on a tiny checkpoint pruned by ``bytediet quantize``: history, resume, reload, bad input."""

from __future__ import annotations

import json

import pytest

from bytediet.cli import main
from bytediet.models.checkpoint import read_config
from tests.eval.test_harness import write_tiny_checkpoint


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    src = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-recover"), seed=4)
    out = tmp_path_factory.mktemp("pruned") / "p"
    assert (
        main(
            [
                "quantize",
                "--model",
                str(src),
                "--out",
                str(out),
                "--format",
                "sparse24",
                "--calibrate",
                "sparsegpt",
                "--calib-corpus",
                str(src / "corpus.txt"),
                "--calib-samples",
                "2",
                "--calib-len",
                "32",
                "--no-progress",
                "--json",
            ]
        )
        == 0
    )
    return src, out


def recover_argv(src, pruned, out, *extra):
    return [
        "recover",
        "--model",
        str(pruned),
        "--out",
        str(out),
        "--calib-corpus",
        str(src / "corpus.txt"),
        "--seq-len",
        "24",
        "--eval-windows",
        "1",
        "--eval-tokens",
        "48",
        "--lr",
        "3e-3",
        "--warmup",
        "0",
        "--no-progress",
        "--json",
        *extra,
    ]


def test_recover_reports_perplexity_against_tokens_and_saves_a_loadable_checkpoint(pruned, tmp_path, capsys):
    src, pruned_dir = pruned
    capsys.readouterr()
    assert read_config(pruned_dir)["calibration"]["method"] == "sparsegpt"
    out = tmp_path / "r"
    assert main(recover_argv(src, pruned_dir, out, "--steps", "6", "--eval-every", "3")) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["teacher"] == str(src) and res["steps"] == 6 and res["tokens"] == 6 * 24  # no BOS here
    hist = res["history"]
    assert [h["step"] for h in hist] == [0, 3, 6] and [h["tokens"] for h in hist] == [0, 72, 144]
    assert hist[-1]["ppl"] < hist[0]["ppl"]
    cfg = read_config(out)
    assert cfg["layers"]["model.layers.0.mlp.down_proj"] == "sparse24"
    assert cfg["calibration"]["method"] == "sparsegpt" and cfg["calibration"]["recovery"]["steps_done"] == 6
    assert main(["generate", "--model", str(out), "--prompt", "the sister", "--max-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["generated_tokens"] >= 1


def test_token_budget_and_resume(pruned, tmp_path, capsys):
    src, pruned_dir = pruned
    state = tmp_path / "state.pt"
    assert (
        main(
            recover_argv(
                src,
                pruned_dir,
                tmp_path / "a",
                "--steps",
                "4",
                "--tokens",
                "48",
                "--state",
                str(state),
                "--eval-windows",
                "0",
            )
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["steps"] == 2  # 24 tokens a step: the budget stops it at 2
    assert (
        main(
            recover_argv(src, pruned_dir, tmp_path / "b", "--steps", "4", "--state", str(state), "--eval-windows", "0")
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert res["steps"] == 4 and res["tokens"] == 96  # resumed at step 2


def test_bad_input(pruned, tmp_path, capsys):
    src, pruned_dir = pruned
    assert main(recover_argv(src, src / "corpus.txt", tmp_path / "x", "--steps", "1")) == 2
    assert "pruned or INT4 bytediet checkpoint directory" in capsys.readouterr().err
    assert main(recover_argv(src, pruned_dir, tmp_path / "y", "--steps", "0")) == 2
    assert "steps" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()
