"""``bytediet tune --json`` on the default model: one JSON object, a table saved under this machine's key."""
import json

import pytest

from bytediet.cli import main
from bytediet.kernels import tuning
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
    assert set(obj["kernels"].values()) <= {"x4", "rows"} and "3:576:576:1" in obj["kernels"]
    saved = tuning.TuningTable.load(obj["key"])
    assert saved is not None and saved.kernels == obj["kernels"] and str(tmp_path) in obj["path"]
    tuning.forget()
    assert main(["tune", "--threads", "0"]) == 2
