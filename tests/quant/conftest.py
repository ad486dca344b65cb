"""Fixtures for the weight-format tests: a tiny random llama-family model built by the model loader."""

from __future__ import annotations

import pytest
import torch

from bytediet.config import ModelConfig


def make_tiny_model(seed: int = 0, tie: bool = True):
    from bytediet.models.loader import build_model
    from bytediet.quant import get_weight_format

    cfg = ModelConfig(
        architecture="llama",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=tie,
        name="tiny",
    )
    model = build_model(cfg, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.5
    model.model.embed_tokens.weight = torch.nn.Parameter(emb, requires_grad=False)
    fp32 = get_weight_format("fp32")
    for name, layer in model.linear_layers():
        if name == "lm_head" and tie:
            layer.set_packed(fp32, {"weight": model.model.embed_tokens.weight.data})
        else:
            layer.set_weight(torch.randn(layer.out_features, layer.in_features, generator=gen) * 0.1, fp32)
    return model


@pytest.fixture
def tiny_model():
    return make_tiny_model()


@pytest.fixture
def model_factory():
    """``model_factory(seed=0, tie=True)`` → a fresh tiny model."""
    return make_tiny_model
