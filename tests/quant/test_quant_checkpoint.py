"""Saved quantized checkpoints: round trip, checksums, config mismatch, atomic writes."""

from __future__ import annotations

import json

import pytest
import torch

from bytediet.errors import CheckpointError
from bytediet.models import checkpoint as ckpt
from bytediet.models.checkpoint import load_quantized, save_quantized
from bytediet.models.quantize import QuantizeConfig, quantize

MIXED = QuantizeConfig(
    format="int4-g32-sym",
    overrides={
        "lm_head": "int8",
        "*.layers.0.self_attn.*": "nvfp4",
        "*.layers.0.mlp.*": "gguf-q4_1",
        "*.up_proj": "fp8",
        "*.layers.1.self_attn.o_proj": "mxfp4",
    },
    calibration={"method": "none"},
)


def _saved(make, tmp_path, tie=True):
    model = make(tie=tie)
    quantize(model, MIXED)
    out = save_quantized(model, None, tmp_path / "q", source_path=None)
    return model, out


@pytest.mark.parametrize("tie", [True, False])
def test_round_trip_is_exact(model_factory, tmp_path, tie):
    model, out = _saved(model_factory, tmp_path, tie)
    loaded, tokenizer = load_quantized(out)
    assert tokenizer is None
    a, b = dict(model.linear_layers()), dict(loaded.linear_layers())
    for name in a:
        assert b[name].format.spec() == a[name].format.spec()
        assert torch.equal(b[name].dequantized_weight(), a[name].dequantized_weight())
    ids = torch.arange(12) * 7 % 96
    assert torch.equal(loaded.score(ids), model.score(ids))
    assert loaded.quantize_config == MIXED
    config = json.loads((out / ckpt.CONFIG_FILE).read_text())
    assert config["layers"]["lm_head"] == "int8" and config["calibration"] == {"method": "none"}
    assert set(config["files"]) == {ckpt.WEIGHTS_FILE}


def test_tied_embedding_is_stored_once(model_factory, tmp_path):
    model = model_factory(tie=True)
    quantize(model, QuantizeConfig(format="int8", skip=("lm_head",)))
    out = save_quantized(model, None, tmp_path / "q")
    config = json.loads((out / ckpt.CONFIG_FILE).read_text())
    assert config["aliases"] == {"lm_head.packed_weight": "model.embed_tokens.weight"}
    loaded, _ = load_quantized(out)
    assert loaded.lm_head.packed["weight"].data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_corrupt_file_is_rejected(model_factory, tmp_path):
    _, out = _saved(model_factory, tmp_path)
    data = bytearray((out / ckpt.WEIGHTS_FILE).read_bytes())
    data[-1] ^= 0xFF
    (out / ckpt.WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        load_quantized(out)


def test_config_that_does_not_fit_the_model_is_rejected(model_factory, tmp_path):
    _, out = _saved(model_factory, tmp_path)
    config = json.loads((out / ckpt.CONFIG_FILE).read_text())
    config["model_config"]["num_layers"] = 3
    config["model_config"]["layer_types"] = ["full"] * 3
    (out / ckpt.CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="layers do not match"):
        load_quantized(out)


def test_existing_directory_is_not_overwritten_by_default(model_factory, tmp_path):
    model, out = _saved(model_factory, tmp_path)
    with pytest.raises(CheckpointError, match="already exists"):
        save_quantized(model, None, out)
    save_quantized(model, None, out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_failed_save_leaves_nothing(model_factory, tmp_path, monkeypatch):
    model = model_factory()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_quantized(model, None, tmp_path / "q")
    assert list(tmp_path.iterdir()) == []


def test_not_a_checkpoint(model_factory, tmp_path):
    with pytest.raises(CheckpointError, match="not a bytediet checkpoint"):
        load_quantized(tmp_path)


@pytest.mark.slow  # ~30 s: GGUFReader parses the 49k-token vocabulary three times
def test_tokenizer_and_source_from_the_default_model(model_factory, tmp_path):
    try:
        from bytediet.models.loader import default_model_path

        source = default_model_path()
    except Exception as exc:
        pytest.skip(f"default model not available: {exc}")
    model = model_factory()
    quantize(model, "int8")
    out = save_quantized(model, source, tmp_path / "q", source_path=source)
    config = json.loads((out / ckpt.CONFIG_FILE).read_text())
    assert config["source"]["sha256"] == ckpt.sha256_of(source)
    assert (out / ckpt.TOKENIZER_GGUF).stat().st_size < source.stat().st_size / 4  # metadata only
    _, tokenizer = load_quantized(out)
    from bytediet.models.tokenizer import load_tokenizer

    ref = load_tokenizer(source)
    text = "It is a truth universally acknowledged"
    assert tokenizer.encode(text) == ref.encode(text)
