"""Shared fixtures: tiny random-weights models (one per architecture) and the two real models.

``tiny_model(arch)`` builds a 2-layer model with random weights; ``smollm2`` / ``gemma3`` load the
real checkpoints once per session (float32).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import settings

from bytediet.config import ModelConfig
from bytediet.models.gemma3 import gemma3_layer_types
from bytediet.models.loader import build_model
from bytediet.quant import get_weight_format

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():  # Triton kernels run in its interpreter here; read before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Property tests draw the same examples on every run (CI must not turn red on a new random draw);
# HYPOTHESIS_PROFILE=explore searches afresh, to look for new counterexamples on purpose.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def tiny_config(arch: str = "llama", **overrides) -> ModelConfig:
    common = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        name=f"tiny-{arch}",
    )
    if arch == "gemma3":
        common.update(
            num_layers=6,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            rope_local_theta=1e4,
            hidden_act="gelu_tanh",
            sliding_window=8,
            layer_types=gemma3_layer_types(6),
            query_pre_attn_scalar=8,
            qk_norm=True,
            sandwich_norm=True,
            embedding_scale=math.sqrt(32),
        )
    if arch == "qwen2":
        common.update(attention_bias=True, tie_word_embeddings=False)
    common.update(overrides)
    return ModelConfig(architecture=arch, **common)


def random_state(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A full HF-named state dict with random weights (norm weights around 1)."""
    g = torch.Generator().manual_seed(seed)
    model = build_model(config)
    shapes = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    for name, lin in model.linear_layers():
        if name == "lm_head" and config.tie_word_embeddings:
            continue
        shapes[f"{name}.weight"] = (lin.out_features, lin.in_features)
        if lin.bias is not None:
            shapes[f"{name}.bias"] = (lin.out_features,)
    for name, p in model.named_parameters():
        if name not in shapes and p.device.type != "meta":
            shapes[name] = tuple(p.shape)
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            state[name] = torch.randn(shape, generator=g) * (0.5 if "embed" in name else 0.15)
    return state


def model_from_state(config: ModelConfig, state: dict[str, torch.Tensor]):
    model = build_model(config)
    modules = dict(model.named_modules())
    fp32 = get_weight_format("fp32")
    for name, t in state.items():
        mod_name, _, kind = name.rpartition(".")
        module = modules[mod_name]
        if kind == "weight" and hasattr(module, "set_weight"):
            module.set_weight(t.clone(), fp32)
        else:
            setattr(module, kind, torch.nn.Parameter(t.clone(), requires_grad=False))
    if config.tie_word_embeddings:
        model.lm_head.set_packed(fp32, {"weight": model.model.embed_tokens.weight.data})
    model.source_path = f"<random {config.name}>"
    return model


@pytest.fixture(params=["llama", "qwen2", "gemma3"])
def tiny_arch(request) -> str:
    return request.param


@pytest.fixture
def tiny_model(tiny_arch):
    config = tiny_config(tiny_arch)
    return model_from_state(config, random_state(config))


@pytest.fixture(scope="session")
def smollm2():
    from bytediet.models.loader import load_model

    return load_model("default")


@pytest.fixture(scope="session")
def gemma3():
    from bytediet.models.loader import load_model

    return load_model("gemma3-270m")


def hf_checkpoint_parts(config, state: dict, arch: str) -> tuple[dict, dict]:
    """(config.json as a dict, the state dict in Hugging Face's convention) of a tiny model: gemma3 stores its
    RMSNorm weights as w − 1."""
    hf_state = {k: (v - 1.0 if arch == "gemma3" and k.endswith("norm.weight") else v) for k, v in state.items()}
    cfg = {
        "model_type": arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
    if arch == "gemma3":
        cfg.update(
            sliding_window=config.sliding_window,
            rope_local_base_freq=config.rope_local_theta,
            query_pre_attn_scalar=config.query_pre_attn_scalar,
            sliding_window_pattern=6,
        )
    return cfg, hf_state
