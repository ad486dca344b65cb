"""The paged-attention transformer against an independent dense implementation written here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bytediet.kvcache.base import AttentionMetadata
from tests.conftest import model_from_state, random_state, tiny_config


def dense_reference(config, state, ids: torch.Tensor) -> torch.Tensor:
    """Plain causal forward over (L,) ids from the state dict: no cache, no paging."""

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * w

    def rope(x, theta):  # x (L, H, D), rotate-half
        d = x.shape[-1]
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv[None]
        cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    L, H, KV, D = ids.shape[0], config.num_heads, config.num_kv_heads, config.head_dim
    x = state["model.embed_tokens.weight"][ids] * config.embedding_scale
    for i in range(config.num_layers):
        p = lambda n: state[f"model.layers.{i}.{n}"]
        lin = lambda t, n: t @ p(n + ".weight").T + (p(n + ".bias") if config.attention_bias else 0)
        h = norm(x, p("input_layernorm.weight"))
        q = lin(h, "self_attn.q_proj").view(L, H, D)
        k = lin(h, "self_attn.k_proj").view(L, KV, D)
        v = lin(h, "self_attn.v_proj").view(L, KV, D)
        if config.qk_norm:
            q, k = norm(q, p("self_attn.q_norm.weight")), norm(k, p("self_attn.k_norm.weight"))
        theta = config.rope_theta_for(i)
        q, k = rope(q, theta), rope(k, theta)
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * config.attention_scale
        qi, ki = torch.arange(L)[:, None], torch.arange(L)[None]
        allowed = ki <= qi
        if config.window_for(i):
            allowed &= ki > qi - config.window_for(i)
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
        o = attn.reshape(L, H * D) @ p("self_attn.o_proj.weight").T
        act = F.silu if config.hidden_act == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
        if config.sandwich_norm:
            x = x + norm(o, p("post_attention_layernorm.weight"))
            h = norm(x, p("pre_feedforward_layernorm.weight"))
        else:
            x = x + o
            h = norm(x, p("post_attention_layernorm.weight"))
        m = (act(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
        x = x + (norm(m, p("post_feedforward_layernorm.weight")) if config.sandwich_norm else m)
    x = norm(x, state["model.norm.weight"])
    head = state["model.embed_tokens.weight"] if config.tie_word_embeddings else state["lm_head.weight"]
    return x @ head.T


def test_paged_forward_matches_dense_reference(tiny_arch):
    config = tiny_config(tiny_arch)
    state = random_state(config, seed=1)
    model = model_from_state(config, state)
    ids = torch.randint(0, config.vocab_size, (37,), generator=torch.Generator().manual_seed(2))
    expected = dense_reference(config, state, ids)
    got = model.score(ids, block_size=4)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_gives_the_same_logits(tiny_model):
    ids = torch.randint(0, tiny_model.config.vocab_size, (45,), generator=torch.Generator().manual_seed(3))
    whole = tiny_model.score(ids, block_size=8)
    for chunk in (1, 7, 16):
        torch.testing.assert_close(tiny_model.score(ids, block_size=8, chunk_size=chunk), whole, atol=1e-5, rtol=1e-5)


def test_ragged_batch_with_scattered_blocks_matches_single_sequences(tiny_model):
    """Two sequences in one step, their blocks interleaved in the pool, equal each run alone."""
    g = torch.Generator().manual_seed(4)
    lens, bs = [13, 6], 4
    seqs = [torch.randint(0, tiny_model.config.vocab_size, (n,), generator=g) for n in lens]
    alone = [tiny_model.score(s, block_size=bs) for s in seqs]
    tables = [[7, 2, 5, 0], [3, 6]]  # non-contiguous, interleaved
    positions = torch.cat([torch.arange(n) for n in lens])
    slots = torch.cat([torch.tensor([t[p // bs] * bs + p % bs for p in range(n)]) for t, n in zip(tables, lens)])
    meta = AttentionMetadata(
        positions=positions,
        slot_mapping=slots,
        query_start_loc=torch.tensor([0, lens[0], sum(lens)]),
        context_lens=torch.tensor(lens),
        block_tables=torch.tensor([tables[0], tables[1] + [-1, -1]]),
        block_size=bs,
        query_lens_list=lens,
        context_lens_list=lens,
        seq_ids=[0, 1],
    )
    caches = tiny_model.new_caches(8, bs, "fp32")
    logits = tiny_model(torch.cat(seqs), meta, caches)
    torch.testing.assert_close(logits[: lens[0]], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[lens[0] :], alone[1], atol=1e-5, rtol=1e-5)


def test_sliding_window_limits_what_gemma3_layers_see():
    config = tiny_config("gemma3")
    state = random_state(config, seed=5)
    model = model_from_state(config, state)
    ids = torch.randint(0, config.vocab_size, (30,), generator=torch.Generator().manual_seed(6))
    # with every layer sliding (window 8), token 29 cannot be influenced by token 0 after 6 layers? it can, via
    # hops; so check the mechanism directly: one sliding layer, the last position ignores tokens > window ago.
    one = tiny_config("gemma3", num_layers=1, layer_types=("sliding",))
    st1 = random_state(one, seed=7)
    m1 = model_from_state(one, st1)
    a = m1.score(ids)[-1]
    ids2 = ids.clone()
    ids2[:20] = (ids2[:20] + 1) % config.vocab_size  # change only tokens outside the last 8
    torch.testing.assert_close(m1.score(ids2)[-1], a)
    ids3 = ids.clone()
    ids3[25] = (ids3[25] + 1) % config.vocab_size
    assert not torch.allclose(m1.score(ids3)[-1], a)
    assert model.score(ids).shape == (30, config.vocab_size)


def test_score_rows_gives_score_in_chunks_of_positions(tiny_model):
    ids = torch.arange(3, 203) % tiny_model.config.vocab_size
    full = tiny_model.score(ids)
    parts = list(tiny_model.score_rows(ids, 1, 199, 64))
    assert [lo for lo, _ in parts] == [1, 67, 133] and all(p.shape[0] == 66 for _, p in parts)
    torch.testing.assert_close(torch.cat([p for _, p in parts]), full[1:199], rtol=1e-5, atol=1e-5)
