"""Every registered KV codec against the plain-PyTorch reference, on ragged paged batches of random data.

For each codec: (1) attend == reference attention over the codec's own decoded K/V (tight: the read path
is exact to what is stored); (2) attend ≈ fp32 attention over the true K/V (loose, tolerance by all-in
bits); (3) nbytes() == num_blocks · block_size · bytes_per_token.
"""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch

from bytediet.kernels.reference import attention_over_context, sequence_slots
from bytediet.kvcache import KV_CODECS, AttentionMetadata, get_kv_codec
from bytediet.kvcache.compressed import CompressedCache, CompressedCodec

# every registered name with its default parameters, plus the parametrised specs worth covering
get_kv_codec("fp32")
EXTRA = [
    "turboquant1.5",
    "turboquant2.5",
    "turboquant3",
    "turboquant4",
    "turboquant3.5:qr",
    "turboquant_prod3",
    "kivi4",
    "kivi2g16",
    "qjl4",
    "k=turboquant_prod3,v=turboquant3",
    "k=bf16,v=kivi2",
    "k=int8,v=polarquant",
    "k=q8_0,v=q4_0",
    "hf2",
    "hf4r64",
]


def _available(spec: str) -> bool:
    try:
        get_kv_codec(spec)
    except KeyError:
        return False
    return True


SPECS = KV_CODECS.names() + [s for s in EXTRA if _available(s)]
# every registered codec runs in the default suite; the extra parametrisations run with -m slow
SPEC_PARAMS = KV_CODECS.names() + [pytest.param(s, marks=pytest.mark.slow) for s in EXTRA if _available(s)]


def random_batch_plan(rng: random.Random, num_blocks: int, block_size: int, num_seqs: int, max_len: int):
    """Assign each sequence a random length and random, non-contiguous physical blocks."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    plan = []
    for _ in range(num_seqs):
        length = rng.randint(1, max_len)
        nb = math.ceil(length / block_size)
        plan.append(([free.pop() for _ in range(nb)], length))
    return plan


def step_metadata(plan, done: list[int], new: list[int], block_size: int) -> AttentionMetadata:
    """Metadata for a step where sequence s already has done[s] tokens cached and writes new[s] more."""
    max_blocks = max(len(b) for b, _ in plan)
    tables = torch.full((len(plan), max_blocks), -1, dtype=torch.int64)
    positions, slots = [], []
    for s, (blocks, _) in enumerate(plan):
        tables[s, : len(blocks)] = torch.tensor(blocks)
        pos = torch.arange(done[s], done[s] + new[s])
        positions.append(pos)
        slots.append(sequence_slots(tables[s], done[s] + new[s], block_size)[done[s] :])
    qsl = torch.tensor([0] + new).cumsum(0)
    ctx = [d + n for d, n in zip(done, new)]
    return AttentionMetadata(
        torch.cat(positions),
        torch.cat(slots),
        qsl,
        torch.tensor(ctx),
        tables,
        block_size,
        list(new),
        ctx,
        list(range(len(plan))),
    )


def decoded(cache, slots):
    """What the cache holds for these slots, as float32 (k, v), each (L, H, D)."""
    if isinstance(cache, CompressedCache):
        return cache.decode(slots)
    return cache.k[slots].float(), cache.v[slots].float()  # full-precision cache of full.py


def run_steps(spec: str, *, seed: int, hq=6, hkv=2, d=64, block_size=32, window=None, num_seqs=3):
    """Prefill a random prefix of every sequence, then decode the rest a few tokens per step.

    Returns a list of (output, reference-on-decoded, reference-on-truth) per step.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    codec = get_kv_codec(spec)
    block_size = max(block_size, codec.min_block_size())  # the HF window pages 128-token chunks
    num_blocks = 64 * max(1, block_size // 32)  # the same cache tokens (windowed codecs stage per 2048)
    plan = random_batch_plan(rng, num_blocks, block_size, num_seqs, 150)
    cache = codec.create_cache(0, num_blocks, block_size, hkv, d, torch.float32, "cpu")
    k_true = [torch.randn(n, hkv, d) + 0.5 * torch.randn(1, hkv, d) for _, n in plan]
    v_true = [torch.randn(n, hkv, d) for _, n in plan]
    q_true = [torch.randn(n, hq, d) for _, n in plan]
    done = [0] * len(plan)
    results = []
    scale = d**-0.5
    step = 0
    while any(dn < n for dn, (_, n) in zip(done, plan)):
        # a prefill chunk, three small mixed steps, two pure decode steps (the native attention's, where the
        # codec's pages have one), then the rest as one more prefill chunk
        if step == 0:
            new = [rng.randint(min(5, n), n) for _, n in plan]
        elif step < 4:
            new = [min(n - dn, rng.randint(0, 3)) for dn, (_, n) in zip(done, plan)]
        elif step < 6:
            new = [min(n - dn, 1) for dn, (_, n) in zip(done, plan)]
        else:
            new = [n - dn for dn, (_, n) in zip(done, plan)]
        step += 1
        if sum(new) == 0:
            continue
        meta = step_metadata(plan, done, new, block_size)
        cat = lambda xs: torch.cat([x[dn : dn + m] for x, dn, m in zip(xs, done, new)])
        cache.write(cat(k_true), cat(v_true), meta.slot_mapping)
        out = cache.attend(cat(q_true), meta, scale, window)
        ref_dec, ref_true = [], []
        for s, (_blocks, _) in enumerate(plan):
            if new[s] == 0:
                continue
            ctx = done[s] + new[s]
            q = q_true[s][done[s] : ctx]
            kd, vd = decoded(cache, sequence_slots(meta.block_tables[s], ctx, block_size))
            ref_dec.append(attention_over_context(q, kd, vd, scale, window))
            ref_true.append(attention_over_context(q, k_true[s][:ctx], v_true[s][:ctx], scale, window))
        results.append((out, torch.cat(ref_dec), torch.cat(ref_true)))
        done = [dn + m for dn, m in zip(done, new)]
    return codec, cache, results


def weakest_half_bits(codec, hkv: int, d: int) -> float:
    """All-in bits per coordinate of the less precise of K and V (split specs mix widths)."""
    if isinstance(codec, CompressedCodec):
        return 8 * min(codec.key_half.bytes_per_token(hkv, d), codec.value_half.bytes_per_token(hkv, d)) / (hkv * d)
    return codec.bits_per_coordinate(hkv, d)


def loose_tolerance(spec: str, bits: float) -> float:
    """Relative output error allowed against exact attention, by all-in bits per coordinate.

    Random data with incoherent values is a hard case (the output is a small average of large vectors),
    so these bounds are loose; estimator-based keys (QJL sketches) add variance after the softmax.
    """
    if bits >= 7:
        return 0.06  # fp8 E4M3 keeps 3 mantissa bits
    return min(1.0, 7.0 * 2**-bits) + (0.7 if ("prod" in spec or "qjl" in spec) else 0.0)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("spec", SPEC_PARAMS)
def test_attend_matches_reference(spec, window):
    codec, cache, results = run_steps(spec, seed=zlib.crc32(f"{spec}{window}".encode()) % 1000, window=window)
    bits = weakest_half_bits(codec, 2, 64)
    for out, ref_dec, ref_true in results:
        torch.testing.assert_close(out, ref_dec, atol=2e-5, rtol=1e-4)
        rel = (out - ref_true).norm() / ref_true.norm()
        assert rel < loose_tolerance(spec, bits), f"{spec}: relative error {rel:.3f} at {bits:.2f} bits"


@pytest.mark.parametrize("spec", SPEC_PARAMS)
def test_gqa_shapes_and_single_kv_head(spec):
    # gemma-like: one KV head, 4 query heads, head_dim 256
    _, _, results = run_steps(spec, seed=7, hq=4, hkv=1, d=256, num_seqs=2)
    for out, ref_dec, _ in results:
        torch.testing.assert_close(out, ref_dec, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("spec", SPECS)
def test_nbytes_matches_bytes_per_token(spec):
    codec = get_kv_codec(spec)
    for hkv, d, nb, bs in [(3, 64, 64, 32), (1, 256, 16, 64)]:
        bs = max(bs, codec.min_block_size())
        nb = max(nb, 2048 // bs)  # whole staging periods (KIVI: 512 tokens, the fp16 windows: 2048)
        cache = codec.create_cache(0, nb, bs, hkv, d, torch.float32, "cpu")
        expected = nb * bs * codec.bytes_per_token(hkv, d)
        assert cache.nbytes() == pytest.approx(expected, rel=1e-9), spec


def test_compressed_codecs_are_smaller_than_bf16():
    bf16 = get_kv_codec("bf16").bytes_per_token(3, 64)
    for spec in SPECS:
        if spec not in ("fp32", "bf16", "fp16", "int8", "fp8"):
            assert get_kv_codec(spec).bytes_per_token(3, 64) < bf16, spec


@pytest.mark.parametrize("spec", SPECS)
def test_default_block_size_fits_every_codec(spec):
    # 16 tokens unless the codec needs more (KIVI's 32-token key groups); an explicit size is kept
    from bytediet.kvcache.base import default_block_size
    from bytediet.kvcache.config import CacheConfig

    codec = get_kv_codec(spec)
    size = default_block_size(spec)
    assert size == max(16, codec.min_block_size()) and CacheConfig(kv_cache_dtype=spec).block_size == size
    codec.create_cache(0, 2, size, 3, 64, torch.float32, "cpu")  # raises if the codec cannot page this size
    assert CacheConfig(kv_cache_dtype=spec, block_size=64).block_size == 64
    if spec.startswith("kivi"):
        assert size == (16 if spec.endswith("g16") else 32)
