"""The MoE block: gating rules against brute force, token-grouped experts against a per-token loop,
each expert read once per step, and the errors for MoE families and gating variants bytediet does not know."""

from __future__ import annotations

import dataclasses
import json
import math

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bytediet.errors import CheckpointError, ConfigError
from bytediet.models.checkpoint import load_quantized, save_quantized
from bytediet.models.loader import load_model
from bytediet.models.moe import GATINGS, SparseMoE, grouped_experts
from bytediet.models.native_decode import why_not_native
from bytediet.models.quantize import QuantizeConfig, quantize
from tests.conftest import model_from_state, random_state, tiny_config


def moe_config(**kw):
    base = dict(
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_gating="softmax-topk",
        shared_expert_intermediate_size=24,
        attention_bias=True,
        tie_word_embeddings=False,
    )
    return tiny_config("qwen2_moe", **{**base, **kw})


# ------------------------------------------------------------------------------ gating rules
def brute_force_gating(logits: torch.Tensor, k: int, rule: str, normalize: bool):
    """Per token: rank the experts by hand, pick k, weight them by the rule's formula."""
    out = []
    for row in logits.double().tolist():
        ranked = sorted(range(len(row)), key=lambda e: -row[e])[:k]
        if rule == "topk-softmax":
            z = sum(math.exp(row[e]) for e in ranked)
            w = {e: math.exp(row[e]) / z for e in ranked}
        else:
            z = sum(math.exp(v) for v in row)
            w = {e: math.exp(row[e]) / z for e in ranked}
            if normalize:
                s = sum(w.values())
                w = {e: v / s for e, v in w.items()}
        out.append(w)
    return out


@pytest.mark.parametrize("rule,normalize", [("topk-softmax", True), ("softmax-topk", False), ("softmax-topk", True)])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_gating_rules_equal_brute_force(rule, normalize, k):
    logits = torch.randn(23, 8, generator=torch.Generator().manual_seed(k)) * 3
    weights, ids = GATINGS.get(rule)(logits, k, normalize)
    assert weights.shape == ids.shape == (23, k)
    for w_row, id_row, want in zip(weights.tolist(), ids.tolist(), brute_force_gating(logits, k, rule, normalize)):
        assert set(id_row) == set(want)
        for e, w in zip(id_row, w_row):
            assert w == pytest.approx(want[e], rel=1e-5)


def test_mixtral_rule_equals_softmax_then_renormalized_topk():
    """Softmax over the top-k logits = softmax over all, top-k, renormalized (transformers' Mixtral code)."""
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    a = GATINGS.get("topk-softmax")(logits, 2, True)
    b = GATINGS.get("softmax-topk")(logits, 2, True)
    torch.testing.assert_close(a[0], b[0])
    assert torch.equal(a[1], b[1])


# ------------------------------------------------------------------------------ token-grouped experts
def per_token_reference(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """One token at a time, each of its experts in turn (the loop the grouped path avoids)."""
    logits = x @ block.gate.weight.T
    rows = []
    for t in range(x.shape[0]):
        probs = logits[t].softmax(-1)
        top = probs.topk(block.top_k)
        w = top.values / top.values.sum() if block.normalize else top.values
        y = sum(wi * block.experts[int(e)](x[t : t + 1])[0] for wi, e in zip(w, top.indices))
        gate = torch.sigmoid(x[t] @ block.shared_expert_gate.weight[0])
        rows.append(y + gate * block.shared_expert(x[t : t + 1])[0])
    return torch.stack(rows)


@pytest.mark.parametrize("normalize", [False, True])
def test_sparse_moe_equals_per_token_loop(normalize):
    config = moe_config(norm_topk_prob=normalize)
    model = model_from_state(config, random_state(config, seed=3))
    block = model.model.layers[0].mlp
    x = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(block(x), per_token_reference(block, x), atol=1e-5, rtol=1e-5)


def test_each_expert_runs_once_per_step_on_all_its_tokens():
    config = moe_config(num_experts=8, num_experts_per_tok=3)
    model = model_from_state(config, random_state(config, seed=5))
    block = model.model.layers[1].mlp
    calls: dict[int, list[int]] = {}
    for e, expert in enumerate(block.experts):
        expert.register_forward_hook(lambda m, inp, out, e=e: calls.setdefault(e, []).append(inp[0].shape[0]))
    x = torch.randn(29, config.hidden_size, generator=torch.Generator().manual_seed(6))
    _, ids = block.route(x)
    block(x)
    routed = torch.bincount(ids.reshape(-1), minlength=8).tolist()
    assert {e: n for e, n in enumerate(routed) if n} == {e: rows[0] for e, rows in calls.items()}
    assert all(len(rows) == 1 for rows in calls.values())  # one call per expert: weights read once
    assert sum(routed) == 29 * 3


def test_grouped_experts_scatter_adds_the_weights():
    experts = torch.nn.ModuleList([torch.nn.Identity(), torch.nn.Identity()])
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = grouped_experts(experts, x, torch.tensor([[0.25, 0.75], [1.0, 0.0]]), torch.tensor([[0, 1], [1, 0]]))
    torch.testing.assert_close(out, x)  # weights of each token sum to 1 over identical experts


def test_moe_model_scores_and_batches_like_single_sequences():
    """Chunked prefill through the paged path: a token's experts do not depend on its neighbours."""
    config = moe_config()
    model = model_from_state(config, random_state(config, seed=7))
    ids = torch.randint(0, config.vocab_size, (30,), generator=torch.Generator().manual_seed(8))
    whole = model.score(ids, block_size=8)
    torch.testing.assert_close(model.score(ids, block_size=8, chunk_size=7), whole, atol=1e-5, rtol=1e-5)


def test_moe_parameter_counts():
    config = moe_config(dense_layers=(1,))
    model = model_from_state(config, random_state(config))
    total = sum(p.numel() for p in model.parameters()) + sum(
        lin.out_features * lin.in_features for _, lin in model.linear_layers()
    )
    assert total == config.num_parameters
    one_expert = 3 * config.hidden_size * config.moe_intermediate_size
    assert config.num_parameters - config.num_active_parameters == (6 - 2) * one_expert  # one MoE layer


# ------------------------------------------------------------------------------ engine paths, checkpoints
def test_native_decode_step_declines_moe_models():
    config = moe_config()
    model = model_from_state(config, random_state(config))
    reason = why_not_native(model, model.new_caches(4, 16, "fp32"))
    assert reason is not None and "mixture-of-experts" in reason and "qwen2_moe" in reason


def test_quantized_moe_checkpoint_round_trip(tmp_path):
    config = moe_config()
    model = model_from_state(config, random_state(config, seed=9))
    quantize(model, QuantizeConfig(format="int8"))
    ids = torch.arange(20) % config.vocab_size
    before = model.score(ids)
    save_quantized(model, None, tmp_path / "q")
    loaded, _ = load_quantized(tmp_path / "q")
    assert loaded.config == config
    torch.testing.assert_close(loaded.score(ids), before)


# ------------------------------------------------------------------------------ bad input
def test_unknown_gating_rule_is_named():
    config = dataclasses.replace(moe_config(), moe_gating="sigmoid-topk")
    with pytest.raises(ConfigError, match=r"qwen2_moe MoE: unknown MoE gating rule 'sigmoid-topk'.*softmax-topk"):
        model_from_state(config, {})


def test_bad_top_k_is_a_config_error():
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        moe_config(num_experts_per_tok=7)


def write_hf_config(path, cfg: dict) -> None:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_moe_family_in_hf_directory(tmp_path):
    write_hf_config(tmp_path / "ds", {"model_type": "deepseek_v2", "n_routed_experts": 64})
    with pytest.raises(CheckpointError, match=r"unsupported MoE family 'deepseek_v2'.*mixtral.*olmoe.*qwen2_moe"):
        load_model(tmp_path / "ds")


def test_unknown_gating_variant_in_hf_config(tmp_path):
    write_hf_config(
        tmp_path / "m",
        {
            "model_type": "mixtral",
            "scoring_func": "sigmoid",
            "vocab_size": 8,
            "hidden_size": 8,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
        },
    )
    with pytest.raises(CheckpointError, match=r"mixtral MoE: scoring_func 'sigmoid' is not a gating variant"):
        load_model(tmp_path / "m")


def write_gguf_header(path, arch: str, **extra) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in dict(
        block_count=1,
        embedding_length=8,
        feed_forward_length=8,
        vocab_size=8,
        **{"attention.head_count": 2},
        expert_count=4,
        expert_used_count=2,
    ).items():
        w.add_uint32(f"{arch}.{key}", value)
    for key, value in extra.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((8, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unknown_moe_family_in_gguf(tmp_path):
    write_gguf_header(tmp_path / "x.gguf", "dbrx")
    with pytest.raises(CheckpointError, match=r"unsupported MoE family 'dbrx'"):
        load_model(tmp_path / "x.gguf")


@pytest.mark.parametrize("arch,family", [("llama", "mixtral"), ("qwen2moe", "qwen2_moe"), ("olmoe", "olmoe")])
def test_unknown_gating_variant_in_gguf(tmp_path, arch, family):
    write_gguf_header(tmp_path / "x.gguf", arch, expert_gating_func=int(gguf.ExpertGatingFuncType.SIGMOID))
    with pytest.raises(CheckpointError, match=rf"{family} MoE: expert_gating_func 'sigmoid' is not a gating variant"):
        load_model(tmp_path / "x.gguf")


def test_dense_mlp_is_untouched_by_moe_fields():
    """A dense config builds the plain MLP (the MoE path is opt-in by num_experts)."""
    model = model_from_state(tiny_config("llama"), random_state(tiny_config("llama")))
    assert type(model.model.layers[0].mlp).__name__ == "MLP"
    assert F.silu is model.model.layers[0].mlp.act


def test_scale_folding_refuses_an_moe_layer_by_name():
    from bytediet.calibrate.folding import scale_groups

    config = moe_config()
    model = model_from_state(config, random_state(config))
    with pytest.raises(ConfigError, match=r"model.layers.0: scale folding .* mixture of experts"):
        scale_groups(model.model.layers[0], "model.layers.0")
    assert len(scale_groups(model.model.layers[0], "model.layers.0", ("o", "qkv"))) == 2


def test_decode_weight_bytes_count_only_the_top_k_experts():
    config = moe_config(dense_layers=(1,))
    model = model_from_state(config, random_state(config))
    expert = 3 * config.hidden_size * config.moe_intermediate_size * 4  # fp32
    assert model.weight_bytes() - model.decode_weight_bytes() == (6 - 2) * expert  # one MoE layer
    dense = model_from_state(tiny_config("llama"), random_state(tiny_config("llama")))
    assert dense.decode_weight_bytes() == dense.weight_bytes()


def test_experts_in_a_dense_family_are_refused(tmp_path):
    write_gguf_header(tmp_path / "x.gguf", "qwen2")
    with pytest.raises(CheckpointError, match=r"qwen2 with 4 experts is not an MoE family"):
        load_model(tmp_path / "x.gguf")
    write_hf_config(
        tmp_path / "q",
        {
            "model_type": "qwen2",
            "num_experts": 8,
            "vocab_size": 8,
            "hidden_size": 8,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        },
    )
    with pytest.raises(CheckpointError, match=r"model_type 'qwen2' with 8 experts is not an MoE family"):
        load_model(tmp_path / "q")
