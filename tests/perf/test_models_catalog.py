"""Named model configurations carry the published parameter counts."""

from __future__ import annotations

import pytest

from bytediet.errors import ConfigError
from bytediet.perf.models_catalog import MODELS, get_model_config

PUBLISHED = {  # parameters, from each model card / paper
    "llama-2-7b": 6.74e9,
    "llama-2-13b": 13.0e9,
    "llama-2-70b": 69.0e9,
    "llama-3-8b": 8.03e9,
    "llama-3-70b": 70.6e9,
    "smollm2-135m": 134.5e6,
    "gemma-3-270m": 268e6,
    "mixtral-8x7b": 46.7e9,
    "qwen1.5-moe-a2.7b": 14.3e9,
    "olmoe-1b-7b": 6.9e9,
}
ACTIVE = {"mixtral-8x7b": 12.9e9, "qwen1.5-moe-a2.7b": 2.7e9, "olmoe-1b-7b": 1.3e9}  # per token, same sources


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts(name):
    cfg = get_model_config(name)
    assert cfg.name == name
    assert cfg.num_parameters == pytest.approx(PUBLISHED[name], rel=0.01)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_active_parameter_counts(name):
    """MoE models read only the top-k experts per token; a dense model reads every parameter."""
    cfg = get_model_config(name)
    assert cfg.num_active_parameters == pytest.approx(ACTIVE.get(name, PUBLISHED[name]), rel=0.02)


def test_gqa_and_gemma_layout():
    assert get_model_config("llama-2-70b").num_kv_heads == 8
    assert get_model_config("llama-2-13b").num_kv_heads == 40
    g = get_model_config("gemma-3-270m")
    assert g.layer_types.count("full") == 3 and g.sliding_window == 512
    assert set(MODELS.names()) == set(PUBLISHED)


def test_unknown_model_is_a_config_error():
    with pytest.raises(ConfigError, match="llama-2-70b"):
        get_model_config("no-such-model")


@pytest.mark.slow  # the loader reads the GGUF metadata (the Gemma vocabulary alone takes a minute)
@pytest.mark.parametrize("spec,name", [("default", "smollm2-135m"), ("gemma3-270m", "gemma-3-270m")])
def test_catalogue_matches_the_checkpoints_the_engine_loads(spec, name):
    loader = pytest.importorskip("bytediet.models.loader")
    from bytediet.errors import CheckpointError

    try:
        real = loader.load_config(spec)
    except CheckpointError as exc:
        pytest.skip(f"checkpoint not installed: {exc}")
    ours = get_model_config(name)
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "tie_word_embeddings",
        "layer_types",
        "sliding_window",
        "qk_norm",
        "sandwich_norm",
    ):
        assert getattr(ours, key) == getattr(real, key), key
    assert ours.num_parameters == real.num_parameters


def test_a_non_catalogue_spec_goes_to_the_loader(monkeypatch):
    loader = pytest.importorskip("bytediet.models.loader")
    fake = lambda spec: get_model_config("llama-2-7b") if spec == "x.gguf" else None
    monkeypatch.setattr(loader, "load_config", fake)
    assert get_model_config("x.gguf").num_parameters == get_model_config("llama-2-7b").num_parameters
