"""Named model configurations for the roofline analyzer (published hyper-parameters, no weights).

Sources (each model's ``config.json`` on the Hugging Face Hub):
- Llama 2 (Touvron et al. 2023, arXiv:2307.09288): meta-llama/Llama-2-{7b,13b,70b}-hf
- Llama 3 (Grattafiori et al. 2024, arXiv:2407.21783): meta-llama/Meta-Llama-3-{8B,70B}
- SmolLM2 (Allal et al. 2025, arXiv:2502.02737): HuggingFaceTB/SmolLM2-135M-Instruct
- Gemma 3 (Gemma Team 2025, arXiv:2503.19786): google/gemma-3-270m
- Mixtral (Jiang et al. 2024, arXiv:2401.04088): mistralai/Mixtral-8x7B-v0.1 (46.7 B total, 12.9 B active)
- Qwen1.5-MoE (Qwen team 2024, qwenlm.github.io/blog/qwen-moe): Qwen/Qwen1.5-MoE-A2.7B (14.3 B total, 2.7 B active)
- OLMoE (Muennighoff et al. 2024, arXiv:2409.02060): allenai/OLMoE-1B-7B-0924 (6.9 B total, 1.3 B active)
"""

from __future__ import annotations

from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError
from ..registry import Registry

MODELS: Registry = Registry("model configuration")


def _llama(
    name: str,
    vocab: int,
    hidden: int,
    inter: int,
    layers: int,
    heads: int,
    kv: int,
    *,
    rope: float,
    max_pos: int,
    tie: bool = False,
    eps: float = 1e-5,
) -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hidden // heads,
        rms_norm_eps=eps,
        rope_theta=rope,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie,
        name=name,
    )


for _name, _args, _kw in (
    ("llama-2-7b", (32000, 4096, 11008, 32, 32, 32), dict(rope=1e4, max_pos=4096)),
    ("llama-2-13b", (32000, 5120, 13824, 40, 40, 40), dict(rope=1e4, max_pos=4096)),
    ("llama-2-70b", (32000, 8192, 28672, 80, 64, 8), dict(rope=1e4, max_pos=4096)),
    ("llama-3-8b", (128256, 4096, 14336, 32, 32, 8), dict(rope=5e5, max_pos=8192)),
    ("llama-3-70b", (128256, 8192, 28672, 80, 64, 8), dict(rope=5e5, max_pos=8192)),
    ("smollm2-135m", (49152, 576, 1536, 30, 9, 3), dict(rope=1e5, max_pos=8192, tie=True)),
):
    MODELS.register(_name)(lambda n=_name, a=_args, k=_kw: _llama(n, *a, **k))


@MODELS.register("gemma-3-270m")
def gemma_3_270m() -> ModelConfig:
    layers = 18
    # five sliding-window layers then one global layer, repeated (layers 6, 12, 18 are global)
    types = tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(layers))
    return ModelConfig(
        architecture="gemma3",
        vocab_size=262144,
        hidden_size=640,
        intermediate_size=2048,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=1,
        head_dim=256,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_local_theta=1e4,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        hidden_act="gelu_tanh",
        sliding_window=512,
        layer_types=types,
        query_pre_attn_scalar=256,
        qk_norm=True,
        sandwich_norm=True,
        embedding_scale=640**0.5,
        name="gemma-3-270m",
    )


@MODELS.register("mixtral-8x7b")
def mixtral_8x7b() -> ModelConfig:
    return ModelConfig(
        architecture="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1e6,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_gating="topk-softmax",
        norm_topk_prob=True,
        name="mixtral-8x7b",
    )


@MODELS.register("qwen1.5-moe-a2.7b")
def qwen15_moe_a27b() -> ModelConfig:
    return ModelConfig(
        architecture="qwen2_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        attention_bias=True,
        num_experts=60,
        num_experts_per_tok=4,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        moe_gating="softmax-topk",
        name="qwen1.5-moe-a2.7b",
    )


@MODELS.register("olmoe-1b-7b")
def olmoe_1b_7b() -> ModelConfig:
    return ModelConfig(
        architecture="olmoe",
        vocab_size=50304,
        hidden_size=2048,
        intermediate_size=1024,
        num_layers=16,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        rope_theta=1e4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        qk_norm=True,
        qk_norm_per_head=False,
        num_experts=64,
        num_experts_per_tok=8,
        moe_gating="softmax-topk",
        name="olmoe-1b-7b",
    )


def get_model_config(name_or_path: str) -> ModelConfig:
    """A catalogue name (``llama-2-70b``), or anything the engine's loader reads (``default``, a path)."""
    key = name_or_path.strip()
    if key.lower() in MODELS:
        return MODELS.get(key)()
    try:
        from ..models.loader import load_config
    except ImportError as exc:
        raise ConfigError(
            f"cannot read {key!r}: the checkpoint loader is not available ({exc}); "
            f"use a catalogue name: {', '.join(MODELS.names())}"
        ) from exc
    try:
        return load_config(key)
    except CheckpointError as exc:
        raise ConfigError(f"unknown model {key!r} ({exc}); catalogue names: {', '.join(MODELS.names())}") from exc
