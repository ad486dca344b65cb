"""The native decode step (one C++ call for all layers) against the module path of the same model."""
import pytest
import torch

from bytediet.kernels.cpu import build
from bytediet.kvcache.base import AttentionMetadata
from bytediet.models.native_decode import native_decoder, why_not_native
from bytediet.quant import get_weight_format
from tests.conftest import model_from_state, random_state, tiny_config

pytestmark = pytest.mark.skipif(build.find_compiler() is None or not build.runnable_variants(),
                                reason="no native kernels on this machine")


def packed_model(arch: str, fmt: str = "gguf-q4_1", head: str = "gguf-q8_0"):
    config = tiny_config(arch)
    model = model_from_state(config, random_state(config))
    for name, lin in model.linear_layers():
        lin.set_weight(lin.dequantized_weight(), get_weight_format(head if name == "lm_head" else fmt))
    return model


def decode_metadata(contexts, block_size=16):
    """Sequences s = 0.. with contexts[s] tokens in consecutive pages; one new token each (the last)."""
    tables, first = [], 0
    for c in contexts:
        n = -(-c // block_size)
        tables.append(list(range(first, first + n)))
        first += n
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables])
    pos = torch.tensor([c - 1 for c in contexts])
    slots = bt[torch.arange(len(contexts)), pos // block_size] * block_size + pos % block_size
    return AttentionMetadata(positions=pos, slot_mapping=slots, query_start_loc=torch.arange(len(contexts) + 1),
                             context_lens=pos + 1, block_tables=bt, block_size=block_size,
                             query_lens_list=[1] * len(contexts), context_lens_list=[c for c in contexts],
                             seq_ids=list(range(len(contexts)))), first


def fill_pages(caches, gen=None):
    """Earlier tokens' keys and values, as a prefill would have left them (written through each codec)."""
    for c in caches:
        n = c.num_blocks * c.block_size if hasattr(c, "num_blocks") else c.k.shape[0]
        shape = (n, c.num_kv_heads, c.head_dim)
        c.write(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), torch.arange(n),
                torch.arange(n))


def snapshot(caches):
    return [[t.clone() for t in c.tensors()] for c in caches]


def restore(caches, saved):
    for c, ts in zip(caches, saved):
        for t, s in zip(c.tensors(), ts):
            t.copy_(s)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kv", ["bf16", "fp16", "int8", "fp8"])
def test_native_decode_step_over_other_kv_pages_equals_module_path(arch, kv):
    """bf16/fp16 pages and the int8 codec's codes are read in place by the native step, and the new token's
    key and value are written as the torch codec writes them."""
    model = packed_model(arch)
    contexts = [5, 17, 40]
    meta, blocks = decode_metadata(contexts)
    caches = model.new_caches(blocks, 16, kv)
    fill_pages(caches, torch.Generator().manual_seed(0))
    decoder = native_decoder(model, caches)
    assert decoder is not None and decoder.spec.layers[0].kv_dtype == kv
    ids = torch.tensor([3, 50, 7])
    saved = snapshot(caches)
    want = model(ids, meta, caches)
    written = snapshot(caches)
    restore(caches, saved)
    got = decoder.logits(ids, meta, torch.arange(3))
    assert torch.allclose(got, want, atol=2e-3 * want.abs().max().item(), rtol=0)
    for c, w in zip(caches, written):
        for t, ref in zip(c.tensors(), w):
            diff = (t.float() - ref.float()).abs()
            assert diff.max() <= (1 if t.dtype == torch.uint8 else 1e-2 * ref.float().abs().max())


@pytest.mark.parametrize("arch,fmt", [(a, "gguf-q4_1") for a in ("llama", "qwen2", "gemma3")] + [
    ("llama", "int8"), ("qwen2", "int4-g32"), ("gemma3", "int4-g32-sym"), ("llama", "mxfp4"), ("qwen2", "nvfp4"), ("llama", "sparse24-int8")])  # bytediet's formats: repacked layouts
@pytest.mark.parametrize("activations", ["q16", "q8", "f32"])
def test_native_decode_step_equals_module_path(arch, fmt, activations):
    model = packed_model(arch, fmt=fmt)
    for _, lin in model.linear_layers():
        lin.format.with_activations(activations)
    contexts = [5, 17, 40]  # page boundaries, and gemma3's window of 8 cut inside a page
    meta, blocks = decode_metadata(contexts)
    caches = model.new_caches(blocks, 16)
    for c in caches:  # earlier tokens' keys and values, as a prefill would have left them
        c.k.normal_()
        c.v.normal_()
    decoder = native_decoder(model, caches)
    assert decoder is not None
    ids = torch.tensor([3, 50, 7])
    saved = [(c.k.clone(), c.v.clone()) for c in caches]
    want = model(ids, meta, caches)
    for c, (k, v) in zip(caches, saved):
        c.k.copy_(k)
        c.v.copy_(v)
    got = decoder.logits(ids, meta, torch.arange(3))
    # q8 rounds each activation block to 8 bits: a one-ulp difference upstream (the step sums attention in
    # another order) can move a code by one, which the next layers amplify more than q16's or f32's
    tol = 5e-3 if activations == "q8" else 1e-3
    assert torch.allclose(got, want, atol=tol * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("arch,fmt", [("llama", "fp8"), ("gemma3", "fp8"), ("qwen2", "sparse24"),
                                      ("llama", "int8-w8a8"), ("gemma3", "int8-w8a8")])
def test_native_decode_step_with_fixed_activation_formats_equals_module_path(arch, fmt):
    """fp8 and 2:4 fp16 (float activations) and int8-w8a8 (int8 per token): the activations are the format's."""
    model = packed_model(arch, fmt=fmt)
    contexts = [5, 17, 40]
    meta, blocks = decode_metadata(contexts)
    caches = model.new_caches(blocks, 16)
    fill_pages(caches, torch.Generator().manual_seed(1))
    assert why_not_native(model, caches) is None
    decoder = native_decoder(model, caches)
    assert decoder.spec.activations == model.model.layers[0].mlp.down_proj.format.activations
    ids = torch.tensor([3, 50, 7])
    saved = snapshot(caches)
    want = model(ids, meta, caches)
    restore(caches, saved)
    got = decoder.logits(ids, meta, torch.arange(3))
    tol = 5e-3 if fmt == "int8-w8a8" else 1e-3  # 8-bit activations: one-code flips amplified, as q8's
    assert torch.allclose(got, want, atol=tol * want.abs().max().item(), rtol=0)


def test_what_the_native_step_does_not_cover_is_said():
    model = packed_model("llama")
    assert why_not_native(model, model.new_caches(2, 16, "bf16")) is None
    assert why_not_native(model, model.new_caches(2, 16, "int8")) is None
    assert why_not_native(model, model.new_caches(2, 128, "turboquant3.5")).startswith("KV cache")
    assert why_not_native(packed_model("llama", fmt="int8"), model.new_caches(2, 16)) is None
    mixed = packed_model("llama", fmt="int8-w8a8")  # per-token int8 activations, and one layer with float ones
    mixed.model.layers[0].mlp.down_proj.set_weight(mixed.model.layers[0].mlp.down_proj.dequantized_weight(),
                                                   get_weight_format("fp8"))
    assert "mixed activation modes" in why_not_native(mixed, mixed.new_caches(2, 16))
    fp32 = packed_model("llama", fmt="fp32")
    assert "has no native kernel" in why_not_native(fp32, fp32.new_caches(2, 16))
    assert native_decoder(fp32, fp32.new_caches(2, 16)) is None
