"""``bytediet tune --json`` on the default model: one JSON object, a table saved under this machine's key."""

import json

import pytest

from bytediet.cli import main
from bytediet.kernels import ops, tuning
from bytediet.kernels.cpu import build


@pytest.mark.skipif(build.find_compiler() is None or not build.runnable_variants(), reason="no native kernels")
def test_tune_json_on_the_default_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BYTEDIET_TUNE_CACHE", str(tmp_path))
    tuning.forget()
    assert main(["tune", "--repeats", "1", "--batches", "1", "--json"]) == 0
    out = capsys.readouterr().out
    obj = json.loads(out)
    assert out.strip().count("\n") == 0
    assert [3, 576, 576] in obj["shapes"] and [8, 49152, 576] in obj["shapes"]  # Q4_1 layers, the Q8_0 lm_head
    assert set(obj["kernels"].values()) <= {"x4", "rows", "panel", "fp32"} and "3:576:576:1" in obj["kernels"]
    if ops.has_gemm_panel(3):  # the prefill product is tuned too (panel vs fp32 GEMM, tuning.PREFILL_ROWS rows)
        assert obj["kernels"][f"3:576:576:{tuning.PREFILL_ROWS}"] in ("panel", "fp32")
    saved = tuning.TuningTable.load(obj["key"])
    assert saved is not None and saved.kernels == obj["kernels"] and str(tmp_path) in obj["path"]
    tuning.forget()
    assert main(["tune", "--threads", "0"]) == 2
