"""Sharded models against the unsplit model: N ranks as threads of this process, each with its own gloo
group over one in-memory store (the collectives are real; only process spawning is skipped)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from bytediet.distributed.comm import TPGroup, backend_for
from bytediet.distributed.shard import full_shape, load_shard
from bytediet.errors import ConfigError
from bytediet.models.loader import load_model


def run_ranks(world: int, fn):
    """``fn(group)`` on ``world`` threads, one rank each → their results in rank order."""
    store = dist.HashStore()

    def rank_main(rank: int):
        return fn(TPGroup.create(store, rank, world, "cpu", timeout_s=60))

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(rank_main, range(world)))


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2"])
@pytest.mark.parametrize("weights", ["fp32", "int8-af32"])  # float activations: a slice rounds nothing differently
def test_tp2_logits_match_the_unsplit_model(tiny_checkpoints, arch, weights):
    path, _ = tiny_checkpoints[arch]
    full, _ = load_model(path, weights=weights, load_tokenizer=False)
    ids = torch.arange(3, 40) % full.config.vocab_size
    want = full.score(ids, chunk_size=16)  # chunked prefill: later chunks read earlier ones from the cache
    got = run_ranks(2, lambda g: load_shard(g, str(path), weights=weights)[0].score(ids, chunk_size=16))
    for logits in got:  # every rank ends with the gathered (whole-vocabulary) logits
        torch.testing.assert_close(logits, want, atol=2e-5, rtol=1e-5)
        assert torch.equal(logits.argmax(-1), want.argmax(-1))


def test_tp3_with_uneven_heads_and_vocabulary(tiny_checkpoints):
    path, _ = tiny_checkpoints["llama"]  # 9 query / 3 KV heads, intermediate 40, vocabulary 97: 33 + 32 + 32
    full, _ = load_model(path, weights="fp32", load_tokenizer=False)
    ids = torch.arange(1, 30)
    got = run_ranks(3, lambda g: load_shard(g, str(path), weights="fp32")[0].score(ids))
    for logits in got:
        torch.testing.assert_close(logits, full.score(ids), atol=2e-5, rtol=1e-5)


def test_each_rank_holds_only_its_slices(tiny_checkpoints):
    path, _ = tiny_checkpoints["llama"]
    shards = run_ranks(2, lambda g: load_shard(g, str(path), weights="int8")[0])
    for shard, (q_heads, kv_heads, inter, vocab) in zip(shards, [(6, 2, 20, 49), (3, 1, 20, 48)]):
        attn, mlp = shard.model.layers[0].self_attn, shard.model.layers[0].mlp
        assert attn.q_proj.packed["qweight"].shape == (q_heads * 8, 48)
        assert attn.k_proj.packed["qweight"].shape == (kv_heads * 8, 48)
        assert attn.o_proj.packed["qweight"].shape == (48, q_heads * 8)
        assert attn.o_proj.packed["scale"].shape == (48,)  # row-parallel: every output row keeps its scale
        assert mlp.down_proj.packed["qweight"].shape == (48, inter)
        assert shard.model.embed_tokens.weight.shape == (vocab, 48)
        # tied lm_head: the embedding's shard itself, no second copy
        assert shard.lm_head.packed["weight"].data_ptr() == shard.model.embed_tokens.weight.data_ptr()
        assert shard.config.num_kv_heads == kv_heads and shard.full_config.num_kv_heads == 3
        caches = shard.new_caches(4, 16)
        assert caches[0].k.shape[-2:] == (kv_heads, 8)  # the KV cache holds this rank's heads only


@pytest.mark.parametrize(
    "weights",
    [
        "int4-g32-af32",
        "int4-g32-a8",
        "int4-g32",
        "int4-g64-sym",
        "fp8",
        "mxfp4",
        "nvfp4",
        "sparse24",
        "sparse24-int8",
        "gguf-q4_1",
        "gguf-q8_0",
    ],
)
def test_packed_formats_at_tp2_match_the_unsplit_model(blocky_checkpoint, weights):
    """Every format quantizes the whole layer, then each rank keeps its slice of the packed tensors (group scales,
    zero points, block scales, 2:4 codes cut consistently): the same logits as the unsplit packed model, up to the
    order the ranks' partial sums add in (≈ 1e-6 at o_proj, grown to ≈ 1e-3 by the random model's later layers)."""
    path, _ = blocky_checkpoint
    full, _ = load_model(path, weights=weights, load_tokenizer=False)
    ids = torch.arange(3, 40) % full.config.vocab_size
    want = full.score(ids, chunk_size=16)
    got = run_ranks(2, lambda g: load_shard(g, str(path), weights=weights)[0].score(ids, chunk_size=16))
    for logits in got:
        torch.testing.assert_close(logits, want, atol=3e-3, rtol=1e-3)
        assert torch.equal(logits.argmax(-1), want.argmax(-1))


def test_a_format_that_cannot_be_split_is_refused_with_what_would_work(tiny_checkpoints):
    path, _ = tiny_checkpoints["llama"]
    with pytest.raises(ConfigError, match="sparse50.*cannot be split.*sparse24"):
        run_ranks(2, lambda g: load_shard(g, str(path), weights="sparse50")[0])


def test_a_cut_inside_a_group_names_the_group_and_what_to_do(blocky_checkpoint):
    path, _ = blocky_checkpoint  # o_proj's 128 input columns cut at 64: not a whole group of 128
    with pytest.raises(ConfigError, match=r"int4-g128.*\[0, 64\).*blocks of 128.*--weights int8"):
        run_ranks(2, lambda g: load_shard(g, str(path), weights="int4-g128")[0])


def test_backend_follows_the_device():
    assert backend_for("cpu") == "gloo" and backend_for(torch.device("cuda", 0)) == "nccl"


@pytest.mark.parametrize("spec", ["fp8", "qjl", "turboquant4"])
def test_calibrated_kv_codec_state_is_sliced_to_each_ranks_heads(tiny_checkpoints, spec):
    """Per-KV-head calibration (fp8 scales, QJL / TurboQuant means and rankings) follows the rank's heads."""
    from bytediet.calibrate.kv import calibrate_codec
    from bytediet.kvcache import get_kv_codec

    path, _ = tiny_checkpoints["llama"]  # 3 KV heads: rank 0 holds heads 0-1, rank 1 head 2
    full, _ = load_model(path, weights="fp32", load_tokenizer=False)
    codec = calibrate_codec(get_kv_codec(spec), full, [torch.arange(5, 69) % 97])
    ids = torch.arange(11, 51)
    want = full.score(ids, kv_codec=codec)
    got = run_ranks(2, lambda g: load_shard(g, str(path), weights="fp32")[0].score(ids, kv_codec=codec))
    for logits in got:
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


def test_gather_object_brings_every_ranks_object_to_rank_0():
    """Pickles of different lengths (padded to the longest on the wire), in rank order; None elsewhere."""
    out = run_ranks(3, lambda g: g.gather_object({"rank": g.rank, "pad": "x" * 100 * g.rank}))
    assert out == [[{"rank": r, "pad": "x" * 100 * r} for r in range(3)], None, None]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_full_shape_is_each_layers_shape_in_the_unsplit_model(tiny_checkpoints, arch):
    path = str(tiny_checkpoints[arch][0])
    whole, _ = load_model(path, weights="fp32", load_tokenizer=False)
    want = {name: (lin.out_features, lin.in_features) for name, lin in whole.linear_layers()}
    for shard in run_ranks(2, lambda g: load_shard(g, path, weights="fp32")[0]):
        got = {
            name: full_shape(name, (lin.out_features, lin.in_features), shard.full_config)
            for name, lin in shard.linear_layers()
        }
        assert got == want
