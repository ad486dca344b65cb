"""A block's pages as bytes and back: bit for bit in lossless mode, for every slot-indexed codec; re-encoded smaller."""

from __future__ import annotations

import pytest
import torch

from bytediet.engine.kv_tiers.pages import BlockPages
from bytediet.errors import ConfigError
from bytediet.kvcache import get_kv_codec

H, D, BS, NB, LAYERS = 2, 64, 16, 6, 2


def filled(codec_name: str, dtype=torch.float32, seed=0):
    codec = get_kv_codec(codec_name, dtype)
    caches = [codec.create_cache(i, NB, BS, H, D, dtype, "cpu") for i in range(LAYERS)]
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(NB * BS)
    for c in caches:
        k, v = (torch.randn(NB * BS, H, D, generator=g) for _ in range(2))
        c.write(k.to(dtype), v.to(dtype), slots, slots % (2 * BS))
    return codec, caches


def block(caches, b):
    return [t[b * BS : (b + 1) * BS].clone() for c in caches for t in c.tensors()]


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "q8_0", "q4_0", "rot-q8_0", "turboquant3.5"])
def test_lossless_round_trip_is_bit_exact(name):
    codec, caches = filled(name)
    pages = BlockPages(caches, BS, codec.name)
    want = block(caches, 2)
    data = pages.read(2, 0)
    assert data.dtype == torch.uint8 and data.numel() == pages.block_bytes
    pages.write(4, data, 0)
    for a, b in zip(want, block(caches, 4)):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "q4_0", "turboquant3.5"])
def test_many_blocks_at_once_equal_one_at_a_time(name):
    codec, caches = filled(name, seed=1)
    pages = BlockPages(caches, BS, codec.name)
    src, dst = [3, 0, 2], [5, 1, 4]  # out of order, not adjacent
    want = [block(caches, b) for b in src]
    datas = pages.read_many(src, [0, BS, 0])
    assert [torch.equal(d, pages.read(b, 0)) for d, b in zip(datas, src)] == [True] * 3
    assert len({d.data_ptr() for d in datas}) == 3  # each block its own buffer (the RAM tier frees them singly)
    pages.write_many(dst, datas, [0, BS, 0])
    for w, b in zip(want, dst):
        for x, y in zip(w, block(caches, b)):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_a_codec_with_per_sequence_state_is_refused_with_a_clear_error():
    codec, caches = filled("kivi2g16")
    with pytest.raises(ConfigError, match="per-slot pages"):
        BlockPages(caches, BS, codec.name)


def test_re_encoded_at_rest_is_smaller_and_close():
    _, caches = filled("bf16", torch.bfloat16)
    lossless = BlockPages(caches, BS, "bf16")
    smaller = BlockPages(caches, BS, "bf16", get_kv_codec("rot-q8_0"), torch.bfloat16)
    assert lossless.block_bytes / smaller.block_bytes >= 1.8
    want = [t.float() for t in block(caches, 1)]
    smaller.write(5, smaller.read(1, BS), BS)
    for a, b in zip(want, block(caches, 5)):
        assert (a - b.float()).abs().max() < 0.05 * a.abs().max()


def test_a_load_writes_pages_made_in_inference_mode_from_another_thread():
    import threading

    with torch.inference_mode():  # as a pool built inside the engine's step would be
        codec, caches = filled("bf16", torch.bfloat16)
    pages = BlockPages(caches, BS, codec.name)
    data, errors = pages.read(1, BS), []
    worker = threading.Thread(target=lambda: _catch(errors, pages.write_many, [3], [data], [BS]))
    worker.start()
    worker.join()
    assert errors == [] and torch.equal(pages.read(3, BS), data)


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # the test reports what the thread raised
        errors.append(exc)
