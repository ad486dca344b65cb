"""``bytediet eval`` on a tiny random checkpoint: JSON, table, plots, bad input."""

from __future__ import annotations

import json
import re

import pytest

from bytediet.cli import main
from bytediet.commands import eval as eval_cmd
from tests.eval.test_harness import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-cli"), seed=5)


def argv(ckpt, *extra: str, progress: bool = False) -> list[str]:
    return [
        "eval",
        "--model",
        str(ckpt),
        "--corpus",
        str(ckpt / "corpus.txt"),
        "--windows",
        "2",
        "--window-len",
        "40",
        "--passkey-lengths",
        "260",
        "--passkey-depths",
        "0,1",
        "--speed-tokens",
        "4",
        *extra,
    ] + ([] if progress else ["--no-progress"])


def test_json_prints_exactly_one_object_with_every_task(ckpt, capsys):
    """Progress bars are on (they go to stderr), yet stdout holds the JSON object and nothing else."""
    assert main(argv(ckpt, "--weights", "int8", "--kv-cache-dtype", "int8", "--json", progress=True)) == 0
    out = capsys.readouterr().out
    obj = json.loads(out)  # the whole of stdout is one JSON document ...
    assert out.strip().count("\n") == 0  # ... on one line
    assert set(obj["tasks"]) == {"ppl", "passkey", "speed"}
    assert obj["config"] == {
        "weights": "int8",
        "kv_cache_dtype": "int8",
        "kv_codec": obj["config"]["kv_codec"],
        "kv_calibration": None,
        "kv_offload_codec": None,
        "native_blocks": {},
    }
    assert obj["tasks"]["ppl"]["kl"]["mean"] > 0
    assert len(obj["tasks"]["passkey"]["test"]["cells"]) == 2


def test_kv_calibration_flag_calibrates_codecs_with_hooks(ckpt, capsys):
    assert (
        main(
            argv(
                ckpt,
                "--tasks",
                "ppl",
                "--kv-cache-dtype",
                "turboquant3.5",
                "--kv-calib-windows",
                "1",
                "--kv-calib-len",
                "32",
                "--json",
            )
        )
        == 0
    )
    obj = json.loads(capsys.readouterr().out)
    assert obj["config"]["kv_calibration"] == {
        "corpus": str(ckpt / "corpus.txt"),
        "windows": 1,
        "window_len": 32,
        "seed": 0,
    }
    # the calibrated codec object goes by its spec; kv_codec describes the layout it chose, calibrated
    assert obj["config"]["kv_cache_dtype"] == "turboquant3.5"
    assert (
        obj["config"]["kv_codec"].startswith("turboquant3.5 (k: turboquant3.5 [")
        and "; calibrated]" in obj["config"]["kv_codec"]
    )
    assert (
        main(
            argv(
                ckpt,
                "--tasks",
                "ppl",
                "--kv-cache-dtype",
                "int8",
                "--kv-calib-windows",
                "1",
                "--kv-calib-len",
                "32",
                "--json",
            )
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["config"]["kv_calibration"] is None  # int8 has no hooks


def _table_cells(text: str) -> dict[str, tuple[str, str]]:
    """metric -> (reference, test) strings, read back from the rendered rich table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
        if len(cells) == 4 and cells[1] and cells[0] != "task":
            rows[f"{cells[0]}/{cells[1]}"] = (cells[2], cells[3])
    return rows


def test_table_numbers_equal_the_result_and_plots_are_written(ckpt, tmp_path, capsys, monkeypatch):
    from bytediet.eval import harness

    seen, original = {}, harness.evaluate

    def spy(*args, **kwargs):
        seen["result"] = original(*args, **kwargs)
        return seen["result"]

    # the command imports evaluate at call time, so patching the harness module catches its result
    monkeypatch.setattr(harness, "evaluate", spy)
    assert main(argv(ckpt, "--weights", "int4-g32", "--plot", str(tmp_path / "plots"))) == 0
    out = capsys.readouterr().out
    table = _table_cells(out)
    rows = eval_cmd.table_rows(seen["result"])
    assert len(table) == len(rows) > 20
    for task, metric, ref, test in rows:
        got_ref, got_test = table[f"{task}/{metric}"]
        for got, want in ((got_ref, ref), (got_test, test)):
            if want is None:
                assert got == ""
            else:
                assert float(got) == pytest.approx(want, rel=1e-5, abs=0)
    # a JSON round trip of the same result keeps every number
    assert json.loads(json.dumps(seen["result"]))["tasks"] == seen["result"]["tasks"]
    for name in ("kl_histogram.png", "window_ppl.png"):
        png = tmp_path / "plots" / name
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        import matplotlib.image

        image = matplotlib.image.imread(png)
        assert image.shape[0] > 200 and image.shape[1] > 300 and image[..., :3].std() > 0.01
        assert str(png) in out


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--tasks", "ppl,nope"], "unknown eval task"),
        (["--corpus", "/no/such/file.txt"], "neither a file nor one of"),
        (["--weights", "int3-nope"], "int3-nope"),
        (["--passkey-depths", "0,1.5"], "fractions in \\[0, 1\\]"),
        (["--window-len", "5000"], "exceeds the model's context"),
        (["--kv-pareto", "-tp", "2"], "--kv-pareto .* does not run at --tensor-parallel-size 2"),
        (["-tp", "2", "--kv-cache-dtype", "auto:4.5"], "KV calibration of auto:4.5 .* not at --tensor-parallel-size 2"),
        (["--tensor-parallel-size", "0"], "at least 1"),
        (["--kv-offload-codec", "rot-q8_0"], "--kv-offload-codec is scored by the ppl task"),
    ],
)
def test_bad_input_exits_2_with_a_message(ckpt, capsys, extra, match):
    assert main(argv(ckpt, "--json", *extra)) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and re.search(match, captured.err)


def test_kv_offload_codec_scores_the_kv_as_the_tiers_bring_it_back(ckpt, capsys):
    def ppl(*extra):
        assert main(argv(ckpt, "--json", "--tasks", "ppl", "--kv-cache-dtype", "bf16", *extra)) == 0
        obj = json.loads(capsys.readouterr().out)
        return obj["config"]["kv_offload_codec"], obj["tasks"]["ppl"]["test"]["ppl"]

    pool = ppl()
    same = ppl("--kv-offload-codec", "bf16")  # stored at rest as the pool stores it: nothing changes
    smaller = ppl("--kv-offload-codec", "int8")
    assert pool[0] is None and same == ("bf16", pool[1])
    assert smaller[0] == "int8" and smaller[1] != pool[1]


def test_tensor_parallel_table_says_so_and_equals_size_1(ckpt, capsys):
    assert main(argv(ckpt, "--tasks", "ppl", "--json")) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(argv(ckpt, "--tasks", "ppl", "-tp", "2")) == 0
    table = capsys.readouterr().out
    assert "both across 2 processes" in " ".join(table.split())  # the title wraps
    ref, test = _table_cells(table)["fidelity/perplexity"]
    assert float(ref) == pytest.approx(one["tasks"]["ppl"]["reference"]["ppl"], rel=1e-5)  # 6 significant digits
    assert float(test) == pytest.approx(one["tasks"]["ppl"]["test"]["ppl"], rel=1e-5)


def test_kv_pareto_json_is_one_object_and_the_table_marks_the_frontier(ckpt, capsys, tmp_path):
    extra = (
        "--kv-pareto",
        "--kv-pareto-anchors",
        "k=bf16,v=int8;kivi4",
        "--kv-pareto-codecs",
        "int8,bf16",
        "--kv-pareto-budgets",
        "none",
        "--passkey-lengths",
        "260,4096",
        "--passkey-depths",
        "0.5",
        "--capacity-memory",
        "1MiB",
    )
    assert main(argv(ckpt, *extra, "--json", progress=True)) == 0
    out = capsys.readouterr().out
    obj = json.loads(out)
    assert out.strip().count("\n") == 0
    assert [r["spec"] for r in obj["records"]] == ["k=bf16,v=int8", "kivi4", "int8", "bf16"]
    assert obj["reference"]["kv_cache_dtype"] == "bf16" and obj["frontier"]
    # bf16 on the tiny model: 2 layers × 2 KV heads × 8 × 2 B × 2 = 128 B/token; 1 MiB = 512 blocks of 16 tokens
    assert obj["settings"]["capacity_memory"] == 1 << 20 and obj["reference"]["capacity"]["sequences"] == 2
    assert [(p["length"], p["trials"]) for p in obj["records"][0]["passkey"]] == [(260, 1)]
    assert "passkey at 4096 tokens skipped" in obj["notes"][0]
    mem = obj["memory"]  # the plan printed before loading, and the peak measured
    assert mem["predicted_peak_bytes"] == sum(mem["parts"].values()) and mem["measured_peak_bytes"] > 0
    assert main(argv(ckpt, *extra, "--plot", str(tmp_path))) == 0
    table = capsys.readouterr().out
    assert "* " in table and "kivi4" in table and (tmp_path / "kv_pareto.png").exists()
    assert "pk@260" in table and "seq@4096" in table and "bf16 (reference)" in table and "skipped" in table


def _eval_json(ckpt, capsys, *extra) -> dict:
    assert (
        main(argv(ckpt, "--tasks", "ppl,speed", "--weights", "int8", "--kv-cache-dtype", "int8", "--json", *extra)) == 0
    )
    return json.loads(capsys.readouterr().out)


def test_device_cpu_and_auto_run_on_the_cpu_and_say_so(ckpt, capsys):
    cpu, auto = _eval_json(ckpt, capsys, "--device", "cpu"), _eval_json(ckpt, capsys, "--device", "auto")
    assert cpu["device"] == auto["device"] == {"backend": "native", "device": "cpu"}
    assert cpu["tasks"]["ppl"]["test"]["ppl"] == auto["tasks"]["ppl"]["test"]["ppl"]


def test_triton_backend_runs_both_models_and_their_engines_as_the_native_path(ckpt, capsys, monkeypatch):
    """``BYTEDIET_BACKEND=triton``: the GPU code path (Triton kernels in the interpreter) scores the windows and
    runs the speed task's engine; its perplexities are the native path's."""
    pytest.importorskip("triton", reason="the Triton backend needs triton (the test extra)")
    from bytediet.kernels import backend

    native = _eval_json(ckpt, capsys, "--device", "cpu")
    monkeypatch.setenv("BYTEDIET_BACKEND", "triton")
    calls = []
    attention = backend.attention_over_pages
    monkeypatch.setattr(backend, "attention_over_pages", lambda *a, **k: calls.append(1) or attention(*a, **k))
    triton = _eval_json(ckpt, capsys, "--device", "cpu")
    assert triton["device"] == {"backend": "triton", "device": "cpu", "triton": "interpreter"}
    assert len(calls) >= 2 * 2 * 2  # windows × layers × (reference, test) at least: the Triton attention ran
    for side in ("reference", "test"):
        assert triton["tasks"]["ppl"][side]["ppl"] == pytest.approx(native["tasks"]["ppl"][side]["ppl"], rel=1e-4)
    assert triton["tasks"]["ppl"]["test"]["ppl"] != triton["tasks"]["ppl"]["reference"]["ppl"]  # int8 ran
    assert triton["tasks"]["speed"]["test"]["new_tokens"] == native["tasks"]["speed"]["test"]["new_tokens"] == 4
