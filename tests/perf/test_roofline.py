"""Roofline formulas: the source document's case study, the KV formula, hand-computed and counted FLOPs/bytes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from bytediet.config import ModelConfig
from bytediet.errors import ConfigError
from bytediet.perf.hardware import HardwareSpec, get_hardware
from bytediet.perf.models_catalog import get_model_config
from bytediet.perf.roofline import (
    analyze,
    causal_pairs,
    compare_with_measurement,
    kv_bytes_per_token,
    kv_cache_bytes,
    memory_bound_batch,
    rank_hardware,
    ring_link,
    weights_bytes,
)
from tests.conftest import tiny_config


def close(value: float, target: float, rel: float = 0.05) -> bool:
    return abs(value - target) <= rel * target


# ------------------------------------------------ the case study ("작은 사례 연구")
def test_case_study_70b_fp16_and_int8_on_h100():
    h100 = get_hardware("h100-sxm")
    assert h100.memory_bandwidth == 3.35e12
    cfg = get_model_config("llama-2-70b")
    # a 70B-parameter model in FP16 is ~140 GB; one pass over the weights at 3.35 TB/s is ~42 ms
    assert close(weights_bytes(cfg, 16), 140e9)
    assert close(70e9 * 2 / h100.memory_bandwidth, 42e-3)
    fp16 = analyze(cfg, h100, weights=16, kv=16, batch=1, context=1024)
    assert close(fp16.decode.bytes / h100.memory_bandwidth, 42e-3)
    assert close(fp16.decode_tokens_per_s, 24)
    assert fp16.decode.bound == "memory" and not fp16.fits  # 140 GB does not fit in 80 GB
    # INT8 weights: ~70 GB, ~45-48 tok/s, and the model now fits
    int8 = analyze(cfg, h100, weights=8, kv=16, batch=1, context=1024)
    assert close(int8.weights_bytes, 70e9)
    assert 45 * 0.95 <= int8.decode_tokens_per_s <= 48 * 1.05
    assert int8.fits and int8.max_batch >= 1


def test_case_study_batch_16_one_weight_pass_yields_16_tokens():
    cfg, h100 = get_model_config("llama-2-70b"), get_hardware("h100-sxm")
    one = analyze(cfg, h100, weights=8, kv=16, batch=1, context=512)
    many = analyze(cfg, h100, weights=8, kv=16, batch=16, context=512)
    gemms = ("qkv", "o_proj", "mlp_gate", "mlp_up", "mlp_down")
    w1 = sum(one.decode.op(n).bytes for n in gemms)
    w16 = sum(many.decode.op(n).bytes for n in gemms)
    assert close(w16, w1, rel=0.01)  # the weights are read once per step whatever the batch
    assert many.decode.tokens == 16
    assert many.decode_tokens_per_s > 10 * one.decode_tokens_per_s  # throughput "several times" higher
    assert many.time_per_output_token_s > one.time_per_output_token_s  # per-request latency grows a little
    assert many.decode.op("mlp_up").intensity == pytest.approx(16 * one.decode.op("mlp_up").intensity, rel=0.01)


# ------------------------------------------------ KV cache formula
@given(
    layers=st.integers(1, 96),
    kv_heads=st.integers(1, 16),
    head_dim=st.sampled_from([32, 64, 128, 256]),
    seq=st.integers(1, 1 << 17),
    batch=st.integers(1, 256),
    bits=st.sampled_from([4, 8, 16, 32]),
)
def test_kv_cache_formula(layers, kv_heads, head_dim, seq, batch, bits):
    cfg = ModelConfig("llama", 100, kv_heads * head_dim, 64, layers, kv_heads, kv_heads, head_dim)
    expected = 2 * layers * kv_heads * head_dim * seq * batch * bits / 8
    assert kv_cache_bytes(cfg, seq, batch, bits / 8) == expected
    hw = HardwareSpec("x", "x", {"bf16": 1e12}, memory_bytes=1e15, memory_bandwidth=1e12)
    assert analyze(cfg, hw, weights=16, kv=bits, batch=batch, context=seq).kv_bytes == pytest.approx(expected)


def test_kv_codec_object_is_used():
    class Codec:
        def bytes_per_token(self, num_kv_heads, head_dim):
            return 7.0 * num_kv_heads

    assert kv_bytes_per_token(Codec(), 3, 64) == 21.0
    assert kv_bytes_per_token(16, 3, 64) == 2 * 3 * 64 * 2


# ------------------------------------------------ hand-computed tiny configuration
TINY = ModelConfig(
    "llama",
    vocab_size=10,
    hidden_size=4,
    intermediate_size=6,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
    tie_word_embeddings=True,
)
FAST = HardwareSpec("fast", "fast", {"bf16": 100.0}, memory_bytes=1e6, memory_bandwidth=10.0)


def test_tiny_decode_by_hand():
    p = analyze(TINY, FAST, weights=8, kv=16, batch=1, context=3)
    expected = {  # name: (FLOPs, bytes), worked out on paper; a = 2 bytes, weights 1 byte
        "embedding": (0, 4 * (1 + 2)),
        "qkv": (2 * 4 * 8, 4 * 8 + 4 * 2 + 8 * 2),
        "attention": (4 * 2 * 2 * 3, 3 * 8 + 2 * 2 * 2 * 2),  # 2 cached + 1 new token x 8 B, q and out
        "o_proj": (2 * 4 * 4, 16 + 8 + 8),
        "mlp_gate": (2 * 4 * 6, 24 + 8 + 12),
        "mlp_up": (2 * 4 * 6, 24 + 8 + 12),
        "mlp_down": (2 * 6 * 4, 24 + 12 + 8),
        "norms": (3 * 4 * 4, 3 * 2 * 4 * 2),
        "lm_head": (2 * 4 * 10, 40 + 8 + 20),
    }
    for name, (flops, nbytes) in expected.items():
        op = p.decode.op(name)
        assert (op.flops, op.bytes) == (flops, nbytes), name
        assert op.time == max(flops / 100.0, nbytes / 10.0)
        assert op.bound == ("compute" if flops / 100.0 > nbytes / 10.0 else "memory")
    assert p.time_per_output_token_s == pytest.approx(sum(max(f / 100, b / 10) for f, b in expected.values()))


def test_tiny_prefill_causal_pairs_and_sliding_window():
    assert causal_pairs(5, None) == 15 and causal_pairs(5, 2) == 1 + 2 * 4 and causal_pairs(3, 8) == 6
    p = analyze(TINY, FAST, weights=8, kv=16, batch=2, context=5)
    assert p.prefill.tokens == 10
    assert p.prefill.op("attention").flops == 2 * 4 * 2 * 2 * 15
    assert p.prefill.op("lm_head").flops == 2 * 2 * 4 * 10  # only the last token of each sequence


# ------------------------------------------------ FLOPs against PyTorch's own counter, random configs
def _reference_step(cfg: ModelConfig, batch: int, new: int, ctx: int) -> float:
    """Run the GEMMs of one step of a random llama layer stack under FlopCounterMode."""
    h, d, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    lin = lambda o, i: torch.randn(o, i)
    x = torch.randn(batch, new, h)
    with FlopCounterMode(display=False) as counter:
        for _ in range(cfg.num_layers):
            q = (x @ lin(nh * d, h).T).view(batch, new, nh, d)
            k_new = x @ lin(nkv * d, h).T
            v_new = x @ lin(nkv * d, h).T
            k = torch.randn(batch, ctx, nkv, d).repeat_interleave(nh // nkv, dim=2)
            v = torch.randn(batch, ctx, nkv, d).repeat_interleave(nh // nkv, dim=2)
            s = torch.matmul(q.transpose(1, 2), k.permute(0, 2, 3, 1))  # (B, nh, new, ctx)
            o = torch.matmul(s.softmax(-1), v.transpose(1, 2)).transpose(1, 2).reshape(batch, new, nh * d)
            x = o @ lin(h, nh * d).T + 0 * k_new.sum() + 0 * v_new.sum()
            g, u = x @ lin(cfg.intermediate_size, h).T, x @ lin(cfg.intermediate_size, h).T
            x = (torch.nn.functional.silu(g) * u) @ lin(h, cfg.intermediate_size).T
        x[:, -1] @ lin(cfg.vocab_size, h).T
    return counter.get_total_flops()


@settings(max_examples=15, deadline=None)
@given(
    kv=st.integers(1, 3),
    group=st.integers(1, 3),
    d=st.sampled_from([2, 4, 8]),
    layers=st.integers(1, 3),
    inter=st.integers(1, 40),
    vocab=st.integers(2, 50),
    batch=st.integers(1, 4),
    ctx=st.integers(1, 20),
)
def test_decode_flops_match_flop_counter(kv, group, d, layers, inter, vocab, batch, ctx):
    cfg = ModelConfig("llama", vocab, 8, inter, layers, kv * group, kv, d)
    p = analyze(cfg, FAST, weights=16, kv=16, batch=batch, context=ctx)
    counted = _reference_step(cfg, batch, 1, ctx)
    gemm_ops = ("qkv", "attention", "o_proj", "mlp_gate", "mlp_up", "mlp_down", "lm_head")
    assert sum(p.decode.op(n).flops for n in gemm_ops) == counted


# ------------------------------------------------ tensor parallel
def test_tensor_parallel_splits_weights_and_adds_ring_allreduce():
    cfg, h100 = get_model_config("llama-2-70b"), get_hardware("h100-sxm")
    one = analyze(cfg, h100, weights=16, kv=16, batch=1, context=256, tp=1)
    four = analyze(cfg, h100, weights=16, kv=16, batch=1, context=256, tp=4)
    assert four.decode.op("mlp_up").bytes == pytest.approx(one.decode.op("mlp_up").bytes / 4, rel=1e-3)
    msg = 1 * cfg.hidden_size * 2  # T·h·a bytes per all-reduce: 2 per layer + the embedding's
    logits = 1 * cfg.vocab_size * 2  # B·V·a bytes all-gathered
    expected = ((2 * cfg.num_layers + 1) * (2 * 3 / 4) * msg + 3 / 4 * logits) / (900e9 / 2)
    assert four.decode.allreduce_s == pytest.approx(expected)
    assert four.decode.allreduce_latency_s == 0.0  # the catalogue does not know NVLink's per-hop latency
    assert four.fits and four.capacity_bytes == 4 * 80e9
    with pytest.raises(ConfigError):
        analyze(cfg, HardwareSpec("cpu", "cpu", {"fp32": 1e9}, 1e9, 1e9), tp=2)


def test_the_link_latency_is_paid_per_hop_of_every_collective():
    cfg = get_model_config("llama-2-70b")
    slow = replace(get_hardware("h100-sxm"), interconnect_latency=10e-6)
    base = analyze(cfg, get_hardware("h100-sxm"), weights=16, kv=16, batch=1, context=256, tp=4)
    lat = analyze(cfg, slow, weights=16, kv=16, batch=1, context=256, tp=4)
    hops = (2 * cfg.num_layers + 1) * 2 * 3 + 3  # 2(N−1) per all-reduce, N−1 for the logits' all-gather
    assert lat.decode.allreduce_latency_s == pytest.approx(hops * 10e-6)
    assert lat.decode.allreduce_s - base.decode.allreduce_s == pytest.approx(hops * 10e-6)
    assert lat.decode.time - base.decode.time == pytest.approx(hops * 10e-6)


def test_ring_link_from_a_big_and_a_small_all_reduce():
    # 4 ranks: each moves 2·3/4 = 1.5 messages' bytes; a 4 MiB all-reduce in 6 ms → bus = 1.5·4 MiB / 6 ms
    bus, hop = ring_link(4, 4 << 20, 6e-3, 4096, 1e-3)
    assert bus == pytest.approx(1.5 * (4 << 20) / 6e-3)
    assert hop == pytest.approx((1e-3 - 1.5 * 4096 / bus) / 6)  # 2(N−1) = 6 hops
    assert ring_link(2, 4 << 20, 1e-3, 4096, 1e-9)[1] == 0.0  # never a negative latency


def test_max_batch_and_chips_to_hold():
    cfg, h200 = get_model_config("llama-2-70b"), get_hardware("h200")
    p = analyze(cfg, h200, weights=8, kv=16, batch=1, context=4096)
    per_seq = kv_cache_bytes(cfg, 4096, 1, 2)
    assert p.max_batch == math.floor((141e9 - p.weights_bytes) / per_seq)
    groq = analyze(cfg, get_hardware("groq-lpu"), weights=8, kv=16, batch=1, context=4096)
    assert groq.chips_to_hold == math.ceil((groq.weights_bytes + per_seq) / 230e6)


def test_rank_hardware_orders_latency_and_throughput():
    cfg = get_model_config("llama-3-8b")
    hws = [get_hardware(h) for h in ("h100-sxm", "h200", "b200")]
    r = rank_hardware(cfg, hws, weights=16, kv=16, batches=[1, 16], context=2048)
    assert r["latency_ranking"] == ["b200", "h200", "h100-sxm"]  # decode follows memory bandwidth
    assert all(row["chips"] == 1 for row in r["rows"])


def test_compare_with_measurement():
    cfg = get_model_config("smollm2-135m")
    hw = HardwareSpec("m", "m", {"fp32": 1e11}, 1e10, 1e10, measured=True)
    p = analyze(cfg, hw, weights=32, kv=32, batch=4, context=128)
    r = compare_with_measurement(p, 0.9 * p.decode_tokens_per_s)
    assert r["within_20pct"] and r["error_pct"] == pytest.approx(-10)
    assert r["achieved_bandwidth"] == pytest.approx(0.9 * p.decode.bytes / p.decode.time)
    assert not compare_with_measurement(p, 0.5 * p.decode_tokens_per_s)["within_20pct"]


# ------------------------------------------------ mixture of experts: active against total parameters
TINY_MOE = ModelConfig(
    "qwen2_moe",
    10,
    4,
    8,
    1,
    2,
    1,
    2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=6,
    shared_expert_intermediate_size=2,
    moe_gating="softmax-topk",
)


def test_experts_touched_is_k_for_one_token_and_all_for_many():
    from bytediet.perf.roofline import experts_touched

    assert experts_touched(8, 2, 1) == pytest.approx(2)
    assert experts_touched(8, 8, 1) == pytest.approx(8)
    assert experts_touched(64, 8, 512) == pytest.approx(64)
    assert 2 < experts_touched(8, 2, 4) < 8


def test_tiny_moe_decode_by_hand():
    """One token reads the router, 2 of 4 experts and the shared expert, never all four experts."""
    p = analyze(TINY_MOE, FAST, weights=8, kv=16, batch=1, context=3)
    names = [o.name for o in p.decode.ops]
    assert "mlp_gate" not in names and {"router", "experts", "shared_expert"} <= set(names)
    expected = {  # a = 2 bytes, weights 1 byte; h = 4, E = 4, k = 2, I_e = 6, I_s = 2
        "router": (2 * 4 * 4, 4 * 4 * 2 + 4 * 2 + 4 * 2),
        "experts": (2 * 2 * 3 * 4 * 6, 2 * 3 * 4 * 6 + 2 * (3 * 4 + 3 * 6) * 2),
        "shared_expert": (2 * (3 * 4 * 2 + 4), 3 * 4 * 2 + 4 * 2 + (3 * 4 + 3 * 2) * 2),
    }
    for name, (flops, nbytes) in expected.items():
        op = p.decode.op(name)
        assert (op.flops, op.bytes) == (flops, nbytes), name
    # a long prefill touches every expert: 4 experts' weights, not 2
    long = analyze(TINY_MOE, FAST, weights=8, kv=16, batch=1, context=200).prefill.op("experts")
    assert long.bytes == pytest.approx(4 * 3 * 4 * 6 + 200 * 2 * (3 * 4 + 3 * 6) * 2, rel=1e-6)


def test_mixtral_decode_reads_active_not_total_weights():
    cfg = get_model_config("mixtral-8x7b")
    p = analyze(cfg, get_hardware("h100-sxm"), weights=16, kv=16, batch=1, context=1)
    weight_ops = ("qkv", "o_proj", "router", "experts", "lm_head")
    moved = sum(p.decode.op(n).bytes for n in weight_ops)
    table = cfg.vocab_size * cfg.hidden_size  # the untied embedding table: only one row is read
    norms = cfg.num_layers * 2 * cfg.hidden_size + cfg.hidden_size
    assert moved == pytest.approx(2 * (cfg.num_active_parameters - table - norms), rel=1e-3)
    assert p.weights_bytes == pytest.approx(2 * cfg.num_parameters, rel=1e-3)  # memory holds every expert
    assert p.to_dict()["num_active_parameters"] == cfg.num_active_parameters
    dense_like = analyze(cfg, get_hardware("h100-sxm"), weights=16, kv=16, batch=1024, context=1)
    assert dense_like.decode.op("experts").bytes > 3.5 * p.decode.op("experts").bytes  # all 8 experts at batch 1024


# ------------------------------------------------ where a decode step stops being memory-bound (speculation's limit)
def test_the_memory_bound_batch_is_where_the_weight_products_turn_compute_bound():
    cfg, h100 = get_model_config("llama-3-8b"), get_hardware("h100-sxm")

    def products(batch, rows):
        step = analyze(cfg, h100, weights=4.5, kv=16, batch=batch, context=512, decode_rows=rows).decode
        ops = [o for o in step.ops if o.name not in ("embedding", "attention", "norms")]
        return "compute" if sum(o.t_compute for o in ops) > sum(o.t_memory for o in ops) else "memory"

    plain = memory_bound_batch(cfg, h100, weights=4.5, kv=16, context=512)
    verifying = memory_bound_batch(cfg, h100, weights=4.5, kv=16, context=512, decode_rows=5)
    assert products(plain, 1) == "memory" and products(plain + 1, 1) == "compute"
    assert products(verifying, 5) == "memory" and products(verifying + 1, 5) == "compute"
    # ~295 FLOP/byte at the H100's ridge, 16 GFLOP a row against 4.5 GB of weights: ~80 rows, 16 sequences of 5
    assert 60 <= plain <= 100 and plain // 5 - 1 <= verifying <= plain // 5 + 1
    # a verifying step reads the weights and each sequence's KV once for all its rows, and scores every row
    one = analyze(cfg, h100, weights=4.5, kv=16, batch=1, context=512).decode
    five = analyze(cfg, h100, weights=4.5, kv=16, batch=1, context=512, decode_rows=5).decode
    assert five.op("lm_head").flops == 5 * one.op("lm_head").flops
    assert five.op("qkv").bytes < 1.01 * one.op("qkv").bytes
    assert five.op("attention").flops == pytest.approx(5 * one.op("attention").flops)


def test_a_tiny_model_whose_activations_outweigh_its_weights_stays_memory_bound():
    cfg = tiny_config("llama")  # hidden 32: a row's activations weigh more than its share of the weights
    assert memory_bound_batch(cfg, get_hardware("h100-sxm"), most=256) == 256  # the cap: never compute-bound
    assert memory_bound_batch(cfg, get_hardware("h100-sxm"), most=100) == 100  # a cap between powers of two
