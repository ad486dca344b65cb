"""Run configuration files: round trip, validation, engine kwargs, per-module overrides."""

from __future__ import annotations

import json

import pytest

from bytediet.errors import ConfigError
from bytediet.optimize.run_config import RunConfig, load_run_config, read_run_config
from tests.eval.test_harness import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"))


def test_round_trip_and_engine_kwargs(tmp_path, ckpt):
    cfg = RunConfig(
        model=str(ckpt),
        weights="int8",
        kv_cache_dtype="int8",
        engine={"block_size": 32},
        notes={"expected": {"ppl": 1.5}},
    )
    path = cfg.write(tmp_path / "run.json")
    assert read_run_config(path) == cfg
    kwargs = load_run_config(path)
    assert kwargs == {
        "model": str(ckpt),
        "dtype": "float32",
        "weights": "int8",
        "kv_cache_dtype": "int8",
        "block_size": 32,
    }
    from bytediet.engine.llm import LLM

    llm = LLM(**kwargs)
    specs = {name: layer.format.spec() for name, layer in llm.model.linear_layers()}
    assert set(specs.values()) - {specs.pop("lm_head")} == {"int8"}  # lm_head follows quant's output policy


def test_overrides_load_a_quantized_model_per_module(tmp_path, ckpt):
    path = RunConfig(
        model=str(ckpt), weights="int4-g32", weight_overrides={"lm_head": "int8", "model.layers.0.*": "fp32"}
    ).write(tmp_path / "run.json")
    kwargs = load_run_config(path)
    model, _ = kwargs["loaded"]
    assert kwargs["weights"] is None
    specs = {name: layer.format.spec() for name, layer in model.linear_layers()}
    assert specs["lm_head"] == "int8" and specs["model.layers.0.mlp.up_proj"] == "fp32"
    assert specs["model.layers.1.mlp.up_proj"] == "int4-g32"


def test_relative_model_paths_are_relative_to_the_file(tmp_path, ckpt):
    (tmp_path / "run.json").write_text(json.dumps({"model": "ckpt"}))
    (tmp_path / "ckpt").symlink_to(ckpt)
    assert read_run_config(tmp_path / "run.json").model == str(tmp_path / "ckpt")


@pytest.mark.parametrize(
    "data, match",
    [
        ({"model": "default", "wieghts": "int8"}, "unknown key"),
        ({"weights": "int8"}, "'model' is required"),
        ({"model": "default", "weights": "int9"}, "unknown weight format"),
        ({"model": "default", "kv_cache_dtype": "int9"}, "kv_cache_dtype"),
        ({"model": "default", "weight_overrides": {"lm_head": "int8"}}, "needs 'weights'"),
        ({"model": "default", "engine": {"block_sise": 16}}, "unknown engine setting"),
        ({"model": "default", "dtype": "float64"}, "dtype"),
        ({"model": "default", "bytediet_run_config": 7}, "version 7"),
        (
            {"model": "default", "kv_calibration": {"corpus": "austen", "windows": 0, "window_len": 32, "seed": 0}},
            "kv_calibration",
        ),
        ({"model": "default", "kv_calibration": {"corpus": "austen", "windows": 2}}, "kv_calibration"),
        ([1, 2], "one JSON object"),
    ],
)
def test_bad_files_say_what_is_wrong(tmp_path, data, match):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=match):
        read_run_config(path)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        read_run_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_run_config(tmp_path / "bad.json")


def test_kv_calibration_calibrates_the_codec_on_the_same_windows_every_time(tmp_path, ckpt):
    import torch

    cal = {"corpus": str(ckpt / "corpus.txt"), "windows": 1, "window_len": 32, "seed": 0}
    path = RunConfig(model=str(ckpt), kv_cache_dtype="turboquant3.5", kv_calibration=cal).write(tmp_path / "run.json")
    assert read_run_config(path).kv_calibration == cal
    first, second = load_run_config(path), load_run_config(path)
    # the calibrated codec travels as data: its name plus its calibration state, never the object
    assert first["kv_cache_dtype"] == "turboquant3.5" and first["loaded"][0] is not None
    means = first["kv_calibration_state"]["k"]["rope_means"]  # keys: the pre-RoPE mean of each layer
    assert set(means) == set(range(first["loaded"][0].config.num_layers))
    assert all(torch.equal(means[i], second["kv_calibration_state"]["k"]["rope_means"][i]) for i in means)
    # a codec without calibration hooks is left as it is: its spec, which the engine builds
    plain = load_run_config(
        RunConfig(model=str(ckpt), kv_cache_dtype="int8", kv_calibration=cal).write(tmp_path / "int8.json")
    )
    assert plain["kv_cache_dtype"] == "int8" and "kv_calibration_state" not in plain


def test_a_model_handed_over_quantized_carries_its_true_weight_spec(tmp_path, ckpt):
    path = RunConfig(model=str(ckpt), weights="int4-g32", weight_overrides={"lm_head": "int8"}).write(
        tmp_path / "r.json"
    )
    from bytediet import LLM

    llm = LLM(**load_run_config(path))
    assert llm.config.weights == "int4-g32" and llm.config.weight_overrides == {"lm_head": "int8"}


def test_a_calibration_state_in_the_file_is_built_by_the_engine_without_recalibrating(tmp_path, ckpt):
    import torch

    from bytediet import LLM
    from bytediet.kvcache.state import to_plain

    cal = {"corpus": str(ckpt / "corpus.txt"), "windows": 1, "window_len": 32, "seed": 0}
    state = load_run_config(
        RunConfig(model=str(ckpt), kv_cache_dtype="turboquant3.5", kv_calibration=cal).write(tmp_path / "cal.json")
    )["kv_calibration_state"]
    path = RunConfig(model=str(ckpt), kv_cache_dtype="turboquant3.5", kv_calibration_state=to_plain(state)).write(
        tmp_path / "run.json"
    )
    kwargs = load_run_config(path)
    assert "loaded" not in kwargs and kwargs["kv_cache_dtype"] == "turboquant3.5"  # no calibration pass
    llm = LLM(**kwargs)
    assert llm.config.cache.kv_cache_dtype == "turboquant3.5"  # the config holds the name
    built = llm.engine.runner.codec.key_half.rope_means  # the engine owns the object
    assert all(torch.equal(built[i][0], state["k"]["rope_means"][i]) for i in state["k"]["rope_means"])
    assert built[0][1] is llm.model.rope(0)
