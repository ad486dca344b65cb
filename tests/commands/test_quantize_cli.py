"""``bytediet quantize`` on a tiny Hugging Face checkpoint: save, reload, calibration, budgets, bad input."""

from __future__ import annotations

import json

import pytest

from bytediet.cli import main
from bytediet.commands.quantize import parse_overrides
from bytediet.models.checkpoint import read_config
from tests.eval.test_harness import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-quantize"), seed=9)


def quantize_argv(ckpt, out, *extra):
    return [
        "quantize",
        "--model",
        str(ckpt),
        "--out",
        str(out),
        "--calib-corpus",
        str(ckpt / "corpus.txt"),
        "--calib-samples",
        "2",
        "--calib-len",
        "32",
        "--no-progress",
        "--json",
        *extra,
    ]


@pytest.mark.parametrize("method, fmt", [("gptq", "int4-g32"), ("awq", "int4-g32-sym"), ("smoothquant", "int8-w8a8")])
def test_calibrated_checkpoint_saves_and_generate_loads_it(ckpt, tmp_path, capsys, method, fmt):
    out = tmp_path / "q"
    assert (
        main(quantize_argv(ckpt, out, "--format", fmt, "--calibrate", method, "--overrides", "*.layers.0.mlp.*=int8"))
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert res["calibration"]["method"] == method and res["calibration"]["seq_len"] == 32
    assert res["layers"]["model.layers.1.self_attn.q_proj"] == fmt
    assert res["layers"]["model.layers.0.mlp.up_proj"] == "int8"
    assert res["bytes_after"] < res["bytes_before"]
    cfg = read_config(out)
    assert cfg["layers"]["model.layers.1.mlp.down_proj"] == fmt and cfg["calibration"]["method"] == method
    assert cfg["layers"]["lm_head"] == ("int8" if fmt.startswith("int4") else "fp32")  # output policy
    assert main(["generate", "--model", str(out), "--prompt", "the sister", "--max-tokens", "3", "--json"]) == 0
    gen = json.loads(capsys.readouterr().out)
    assert gen["model"] == str(out) and gen["generated_tokens"] >= 1


def test_mixed_precision_budget_writes_overrides(ckpt, tmp_path, capsys):
    out = tmp_path / "mixed"
    assert (
        main(
            quantize_argv(ckpt, out, "--format", "int4-g32", "--max-kl", "0.001", "--candidates", "int4-g32,int8,fp32")
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    mixed = res["mixed_precision"]
    assert mixed["measured"]["kl"] <= 0.001
    assert set(mixed["assignment"]) == {"model.layers.0.*", "model.layers.1.*", "lm_head"}
    for unit, spec in mixed["assignment"].items():
        assert res["layers"]["lm_head" if unit == "lm_head" else unit.replace("*", "mlp.gate_proj")] == spec


def test_bad_input_is_a_clear_error_and_leaves_nothing(ckpt, tmp_path, capsys):
    out = tmp_path / "bad"
    cases = [
        (["--format", "int3"], "unknown weight format"),
        (["--format", "int4-g64"], "valid group sizes"),  # hidden 32: g64 does not divide
        (["--format", "int4-g32", "--calibrate", "gptq", "--calib-samples", "500"], "calibration data too short"),
        (["--format", "int8", "--overrides", "lm_head"], "PATTERN=FORMAT"),
        (["--format", "int8", "--export-gguf", str(tmp_path / "x.gguf")], "needs a .gguf source"),
    ]
    for extra, message in cases:
        assert main(quantize_argv(ckpt, out, *extra)) == 2
        assert message in capsys.readouterr().err
        assert not out.exists() and not list(tmp_path.glob(".bad*"))
    out.mkdir()
    assert main(quantize_argv(ckpt, out, "--format", "int8")) == 2
    assert "already exists" in capsys.readouterr().err


def test_parse_overrides_keeps_order():
    assert list(parse_overrides(" lm_head=int8, *.layers.0.*=fp8 ,")) == ["lm_head", "*.layers.0.*"]


def _dequantized(path) -> dict:
    from bytediet.models.loader import load_model

    model, _ = load_model(str(path))
    return {name: lin.dequantized_weight() for name, lin in model.linear_layers()}


def test_device_cpu_auto_and_the_triton_backend_quantize_alike(ckpt, tmp_path, capsys, monkeypatch):
    """GPTQ's calibration passes run where ``--device`` says; under ``BYTEDIET_BACKEND=triton`` they run the GPU code
    path (Triton kernels in the interpreter) and the checkpoint is the native path's up to rare rounding flips."""
    from bytediet.kernels import backend as kernels_backend

    runs, calls = {}, []
    attention = kernels_backend.attention_over_pages
    monkeypatch.setattr(kernels_backend, "attention_over_pages", lambda *a, **k: calls.append(1) or attention(*a, **k))
    for name, device, backend in (("cpu", "cpu", "auto"), ("auto", "auto", "auto"), ("triton", "cpu", "triton")):
        if backend == "triton":
            pytest.importorskip("triton", reason="the Triton backend needs triton (the test extra)")
        monkeypatch.setenv("BYTEDIET_BACKEND", backend)
        extra = ("--format", "int4-g32", "--calibrate", "gptq", "--device", device)
        assert main(quantize_argv(ckpt, tmp_path / name, *extra)) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    assert runs["cpu"]["device"] == runs["auto"]["device"] == {"backend": "native", "device": "cpu"}
    assert runs["triton"]["device"] == {"backend": "triton", "device": "cpu", "triton": "interpreter"}
    assert len(calls) >= 2 * 2  # calibration windows × layers: the calibration passes ran the Triton attention
    native, triton = _dequantized(tmp_path / "cpu"), _dequantized(tmp_path / "triton")
    assert native.keys() == triton.keys() and len(native) > 1
    for name, w in native.items():  # a code may flip where calibration's sums round apart: not more than a few
        assert (w - triton[name]).abs().mean() <= 0.01 * w.abs().mean(), name
