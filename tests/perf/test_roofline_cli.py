"""``bytediet roofline``: JSON output, plot file, comparison, dataflow, format names and errors."""

from __future__ import annotations

import functools
import json

from bytediet.cli import main
from bytediet.commands.roofline import resolve_kv, resolve_weights
from bytediet.perf import measure as measure_mod


def run_json(capsys, *args: str) -> dict:
    assert main(["roofline", "--json", *args]) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # exactly one JSON object on stdout


def test_json_has_every_prediction(capsys):
    data = run_json(
        capsys,
        "--model",
        "llama-2-70b",
        "--hardware",
        "h100-sxm,h200,tpu-v7",
        "--weights",
        "int8",
        "--kv",
        "bf16",
        "--batch",
        "1,16",
        "--context",
        "4096",
    )
    assert len(data["predictions"]) == 6
    first = data["predictions"][0]
    assert first["hardware"] == "h100-sxm" and first["batch"] == 1
    assert 45 * 0.95 <= first["decode_tokens_per_s"] <= 48 * 1.05
    assert {op["name"] for op in first["decode"]["ops"]} >= {
        "qkv",
        "attention",
        "o_proj",
        "mlp_gate",
        "mlp_up",
        "mlp_down",
        "lm_head",
        "embedding",
        "norms",
    }
    assert data["hardware"]["tpu-v7"]["memory_bandwidth"] == 7.37e12


def test_plot_compare_and_dataflow(capsys, tmp_path):
    png = tmp_path / "roofline.png"
    data = run_json(
        capsys,
        "--model",
        "llama-3-8b",
        "--hardware",
        "h100-sxm,groq-lpu,tpu-v6e",
        "--batch",
        "1,8",
        "--compare",
        "--plot",
        str(png),
        "--dataflow",
        "64,256,128",
        "--sram",
        "64KiB",
        "--tp",
        "1",
    )
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    ranks = data["compare"]
    assert ranks["latency_ranking"][0] == "groq-lpu"  # SRAM bandwidth wins batch-1 decode
    groq = next(r for r in ranks["rows"] if r["hardware"] == "groq-lpu")
    assert groq["chips"] > 60
    assert data["dataflow"]["best"] in data["dataflow"]["dataflows"]


def test_numeric_formats_and_table_output(capsys):
    assert main(["roofline", "--model", "smollm2-135m", "--weights", "4.5", "--kv", "3.5", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "mlp_down" in out and "h100-sxm" in out
    assert resolve_weights("4.5")[1] == 4.5 and resolve_kv("3.5")[1] == 3.5
    assert resolve_weights("fp4")[1] == 4.0


def test_registered_formats_supply_their_own_sizes():
    label, fmt = resolve_weights("fp16")
    assert fmt.bits_per_weight(8, 8) == 16
    label, codec = resolve_kv("bf16")
    assert codec.bytes_per_token(2, 4) == 2 * 2 * 4 * 2


def test_errors_exit_with_code_2(capsys):
    assert main(["roofline", "--weights", "nonsense"]) == 2
    assert "unknown weight format" in capsys.readouterr().err
    assert main(["roofline", "--hardware", "h100-sxm,cray-1"]) == 2
    assert main(["roofline", "--model", "no-such-model"]) == 2
    assert main(["roofline", "--dataflow", "1,2"]) == 2


def test_measure_flag_adds_this_machine(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("BYTEDIET_CACHE", str(tmp_path))
    monkeypatch.setattr(measure_mod, "measure", functools.partial(measure_mod.measure, read_mib=16))
    data = run_json(capsys, "--model", "smollm2-135m", "--hardware", "h100-sxm", "--measure", "--batch", "1")
    hw = data["hardware"]["this-machine"]
    assert hw["measured"] and hw["peak_flops"]["fp32"] > 0
    mine = next(p for p in data["predictions"] if p["hardware"] == "this-machine")
    assert mine["compute_dtype"] == "fp32"
