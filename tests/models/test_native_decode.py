"""The native decode step (one C++ call for all layers) against the module path of the same model.

A float rounding apart (the module path's GEMMs run in MKL, whose summation order depends on the CPU and the thread
count) a value on a quantization boundary rounds to another code, so the two paths are compared on identical pages:
the module path reads the pages the native step wrote, and its own write of the new tokens is compared apart."""

import contextlib
from unittest import mock

import pytest
import torch

from bytediet.kernels.cpu import build
from bytediet.kvcache.base import AttentionMetadata
from bytediet.kvcache.compressed import CompressedCache
from bytediet.kvcache.turboquant import TurboQuantPages
from bytediet.models.native_decode import native_decoder, why_not_native
from bytediet.quant import get_weight_format
from tests.conftest import model_from_state, random_state, tiny_config

pytestmark = pytest.mark.skipif(
    build.find_compiler() is None or not build.runnable_variants(), reason="no native kernels on this machine"
)


def packed_model(arch: str, fmt: str = "gguf-q4_1", head: str = "gguf-q8_0", **overrides):
    config = tiny_config(arch, **overrides)
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
    return AttentionMetadata(
        positions=pos,
        slot_mapping=slots,
        query_start_loc=torch.arange(len(contexts) + 1),
        context_lens=pos + 1,
        block_tables=bt,
        block_size=block_size,
        query_lens_list=[1] * len(contexts),
        context_lens_list=[c for c in contexts],
        seq_ids=list(range(len(contexts))),
    ), first


def fill_pages(caches, gen=None):
    """Earlier tokens' keys and values, as a prefill would have left them (written through each codec)."""
    for c in caches:
        n = c.num_blocks * c.block_size if hasattr(c, "num_blocks") else c.k.shape[0]
        shape = (n, c.num_kv_heads, c.head_dim)
        c.write(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), torch.arange(n), torch.arange(n))


def snapshot(caches):
    return [[t.clone() for t in c.tensors()] for c in caches]


def restore(caches, saved):
    for c, ts in zip(caches, saved):
        for t, s in zip(c.tensors(), ts):
            t.copy_(s)


def module_path_on_native_pages(model, ids, meta, caches, saved):
    """The module path over the pages the native step wrote, its write of the new tokens recorded, not done →
    (logits, the pages that write leaves on ``saved``, the pages before the step); the native pages stay."""
    native, calls = snapshot(caches), []
    with contextlib.ExitStack() as stack:
        for c in caches:
            stack.enter_context(
                mock.patch.object(
                    c,
                    "write",
                    lambda *args, c=c: calls.append(
                        (c, [a.clone() if isinstance(a, torch.Tensor) else a for a in args])
                    ),
                )
            )
        want = model(ids, meta, caches)
    restore(caches, saved)
    for c, args in calls:
        c.write(*args)
    written = snapshot(caches)
    restore(caches, native)
    return want, written


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
    assert decoder is not None and decoder.spec.layers[0].k_dtype == kv
    ids = torch.tensor([3, 50, 7])
    saved = snapshot(caches)
    got = decoder.logits(ids, meta, torch.arange(3))
    want, written = module_path_on_native_pages(model, ids, meta, caches, saved)
    assert torch.allclose(got, want, atol=2e-3 * want.abs().max().item(), rtol=0)
    for c, w in zip(caches, written):  # k, v a float rounding apart: a code one step off on a rounding boundary
        for t, ref in zip(c.tensors(), w):
            diff = (t.float() - ref.float()).abs()
            assert diff.max() <= (1 if t.dtype == torch.uint8 else 1e-2 * ref.float().abs().max())


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kv", ["q8_0", "q5_0", "q4_1", "q4_0", "k=q8_0,v=q4_0", "k=int8,v=q5_0", "k=bf16,v=q4_1"])
def test_native_decode_step_over_llama_cpp_kv_blocks_equals_module_path(arch, kv):
    """llama.cpp's KV block types, keys and values alike or of different types, read in place by the native step,
    the new token's key and value written with llama.cpp's quantizers as the codec writes them (head dim 64: two
    blocks a row; gemma3's window of 8 cut inside a page)."""
    model = packed_model(arch, head_dim=64)
    contexts = [5, 17, 40]
    meta, blocks = decode_metadata(contexts)
    caches = model.new_caches(blocks, 16, kv)
    fill_pages(caches, torch.Generator().manual_seed(3))
    decoder = native_decoder(model, caches)
    assert decoder is not None
    k_dtype, _, v_dtype = kv.replace("k=", "").replace("v=", "").partition(",")
    assert (decoder.spec.layers[0].k_dtype, decoder.spec.layers[0].v_dtype) == (k_dtype, v_dtype or k_dtype)
    ids = torch.tensor([3, 50, 7])
    saved = snapshot(caches)
    got = decoder.logits(ids, meta, torch.arange(3))
    want, written_bytes = module_path_on_native_pages(model, ids, meta, caches, saved)
    assert torch.allclose(got, want, atol=2e-3 * want.abs().max().item(), rtol=0)
    native = snapshot(caches)
    restore(caches, written_bytes)
    written = [c.decode(meta.slot_mapping) for c in caches]
    restore(caches, native)
    slots = meta.slot_mapping
    # k, v a float rounding apart (the step's q16 activations, the module path's floats): a block scale an ulp off,
    # a code one step off where a value sits on a rounding boundary; bf16 keys of gemma3's third layer flipped
    # ~5 % of their roundings (a wrong write differs almost everywhere)
    for c, ws in zip(caches, written_bytes):
        for t, w in zip(c.tensors(), ws):
            assert (t[slots] != w[slots]).float().mean().item() <= 0.1
    for c, w in zip(caches, written):  # decoded: at most one step (q4_0: amax / 8) apart
        for mine, ref in zip(c.decode(slots), w):
            assert ((mine - ref).abs() <= 0.15 * ref.abs().amax(-1, keepdim=True) + 1e-4).all()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize(
    "kv,pages",
    [
        ("rot-int8", ("int8", "int8")),
        ("rot-q8_0", ("q8_0", "q8_0")),
        ("k=rot-q8_0,v=q4_0", ("q8_0", "q4_0")),
        ("k=int8,v=rot-q8_0", ("int8", "q8_0")),
    ],
)
def test_native_decode_step_over_rotated_kv_pages_equals_module_path(arch, kv, pages):
    """Rotated pages (kvcache/rotated.py): the step rotates q and k after RoPE and v before writing, and the
    attention output back after, so logits and the written pages match the module path's."""
    model = packed_model(arch, head_dim=64)
    meta, blocks = decode_metadata([5, 17, 40])
    caches = model.new_caches(blocks, 16, kv)
    fill_pages(caches, torch.Generator().manual_seed(5))
    assert why_not_native(model, caches) is None
    decoder = native_decoder(model, caches)
    layer = decoder.spec.layers[0]
    assert (layer.k_dtype, layer.v_dtype) == pages
    assert (layer.k_rot is None, layer.v_rot is None) == (
        caches[0].keys.rotation is None,
        caches[0].values.rotation is None,
    )
    ids = torch.tensor([3, 50, 7])
    saved = snapshot(caches)
    got = decoder.logits(ids, meta, torch.arange(3))
    want, own = module_path_on_native_pages(model, ids, meta, caches, saved)
    assert torch.allclose(got, want, atol=2e-3 * want.abs().max().item(), rtol=0)
    native = snapshot(caches)
    restore(caches, own)
    written = [c.decode(meta.slot_mapping) for c in caches]
    restore(caches, native)
    for c, w in zip(caches, written):  # decoded in the model's basis: a quantization step apart at most
        for mine, ref in zip(c.decode(meta.slot_mapping), w):
            assert ((mine - ref).abs() <= 0.15 * ref.abs().amax(-1, keepdim=True) + 1e-4).all()


@pytest.mark.parametrize(
    "arch,fmt",
    [(a, "gguf-q4_1") for a in ("llama", "qwen2", "gemma3")]
    + [
        ("llama", "int8"),
        ("qwen2", "int4-g32"),
        ("gemma3", "int4-g32-sym"),
        ("llama", "mxfp4"),
        ("qwen2", "nvfp4"),
        ("llama", "sparse24-int8"),
    ],
)  # bytediet's formats: repacked layouts
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
    tol = 1e-3 * want.abs().max().item()  # fp32 pages, q16 or f32 activations: float rounding only
    if activations == "q8":
        # a float rounding apart an int8 code on a .5 boundary flips, and the flip re-draws the q8 rounding of all
        # that follows: the paths then differ by at most their two q8 rounding errors (triangle inequality), each
        # the size of the module path's own (q8 against q16)
        for c, (k, v) in zip(caches, saved):
            c.k.copy_(k)
            c.v.copy_(v)
        for _, lin in model.linear_layers():
            lin.format.with_activations("q16")
        tol += 2 * (want - model(ids, meta, caches)).abs().max().item()
    assert torch.allclose(got, want, atol=tol, rtol=0)


@pytest.mark.parametrize(
    "arch,fmt",
    [("llama", "fp8"), ("gemma3", "fp8"), ("qwen2", "sparse24"), ("llama", "int8-w8a8"), ("gemma3", "int8-w8a8")],
)
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
    assert why_not_native(model, model.new_caches(2, 128, "kivi4")).startswith("KV cache")
    assert why_not_native(packed_model("llama", fmt="int8"), model.new_caches(2, 16)) is None
    mixed = packed_model("llama", fmt="int8-w8a8")  # per-token int8 activations, and one layer with float ones
    mixed.model.layers[0].mlp.down_proj.set_weight(
        mixed.model.layers[0].mlp.down_proj.dequantized_weight(), get_weight_format("fp8")
    )
    assert "mixed activation modes" in why_not_native(mixed, mixed.new_caches(2, 16))
    fp32 = packed_model("llama", fmt="fp32")
    assert "has no native kernel" in why_not_native(fp32, fp32.new_caches(2, 16))
    assert native_decoder(fp32, fp32.new_caches(2, 16)) is None


# --- TurboQuant pages: attention on codes ----------------------------------------------------------------


def tq_model(arch, **overrides):
    """A tiny model at head dim 64 (TurboQuant's layouts at the real models' head dims)."""
    config = tiny_config(arch, head_dim=64, **overrides)
    model = model_from_state(config, random_state(config))
    for _name, lin in model.linear_layers():
        lin.set_weight(lin.dequantized_weight(), get_weight_format("gguf-q8_0"))
        lin.format.with_activations("f32")
    return model


def calibrated_codec(spec, model, gen, pre_rope: bool = False):
    """``spec`` calibrated on random keys/values with a per-channel offset: a constant mean, outliers, a layout;
    ``pre_rope``: keys RoPE(offset + noise, p) at their positions, calibrated as the engine's calibration does
    (with the layer's RoPE: a pre-RoPE key mean)."""
    from bytediet.kvcache import get_kv_codec

    codec = get_kv_codec(spec, torch.float32)
    c = model.config
    for layer in range(c.num_layers):
        scale = 1 + 4 * torch.rand(c.num_kv_heads, c.head_dim, generator=gen)
        offset = torch.randn(c.num_kv_heads, c.head_dim, generator=gen)
        k, v = (torch.randn(256, c.num_kv_heads, c.head_dim, generator=gen) * scale + offset for _ in range(2))
        if pre_rope:
            rope, positions = model.model.layers[layer].self_attn.rope, torch.arange(256)
            codec.key_half.calibrate(rope(k, positions), layer, positions=positions, rope=rope)
            codec.value_half.calibrate(v, layer)
            assert layer in codec.key_half.rope_means
        else:
            codec.calibrate(k, v, layer)
    return codec


def compare_native_with_module_path(model, caches, meta, decoder, ids, tol=2e-3, codec_read=False):
    """The native step against the module path on the same pages. TurboQuant's nearest-centroid write is
    discontinuous: k and v that differ in their last float bits (another GEMM summation order) flip a code where
    a coordinate sits on a cell boundary, and a deep model amplifies that. So: (1) the codes each path writes
    for the new tokens agree but for such flips; (2) with the native step's codes in place (the module path's
    write skipped), both paths' attention over identical pages agrees to float rounding. ``codec_read``: the module
    path's attention is the codec's own read (CompressedCache's, in torch), not the native kernel it would call."""
    saved = snapshot(caches)
    assert decoder.ready()
    got = decoder.logits(ids, meta, torch.arange(len(ids)))
    native_pages = snapshot(caches)
    restore(caches, saved)
    model(ids, meta, caches)
    slots = meta.slot_mapping
    others = ~torch.isin(torch.arange(caches[0].tensors()[0].shape[0]), slots)
    for layer, (c, w) in enumerate(zip(caches, native_pages)):
        for t, ref in zip(c.tensors(), w):
            assert torch.equal(t[others], ref[others])  # nothing but the new tokens' slots written
            if t.dtype == torch.uint8:  # layer 0: float ties only; deeper, a flip upstream moves k, v more
                assert (
                    (t[slots] != ref[slots]).sum().item() <= 2
                    if layer == 0
                    else (t[slots] != ref[slots]).float().mean().item() <= 0.2
                )
            else:
                assert torch.allclose(t[slots].float(), ref[slots].float(), rtol=2e-3 if layer == 0 else 5e-2, atol=0)
    restore(caches, native_pages)
    with (
        mock.patch.object(TurboQuantPages, "write", lambda self, x, slots, positions=None: None),
        mock.patch.object(
            CompressedCache,
            "attend_natively",
            (lambda *args, **kwargs: None) if codec_read else CompressedCache.attend_natively,
        ),
    ):
        want = model(ids, meta, caches)
    assert torch.allclose(got, want, atol=tol * want.abs().max().item(), rtol=0)
    return got


TQ_CASES = {  # name: (arch, config overrides) — the GQA ratios of the three families and 1:1
    "llama-gqa-3": ("llama", dict(num_heads=6, num_kv_heads=2)),
    "gemma3-gqa-4-window": ("gemma3", dict(num_heads=4, num_kv_heads=1)),
    "qwen2-mha": ("qwen2", dict(num_heads=2, num_kv_heads=2)),
}


@pytest.mark.parametrize("case", sorted(TQ_CASES))
@pytest.mark.parametrize(
    "kv",
    [
        "turboquant3.5",
        "turboquant3",
        "turboquant4.5",
        "cal:turboquant3.5",
        "cal:turboquant2.5",
        "rope:turboquant3.5",
        "rope:turboquant2.5",
    ],
)
def test_native_decode_step_on_turboquant_pages_equals_module_path(case, kv):
    """turboquant KV read on codes by the native step: 1 part (3.5 = 3 bits at head dim 64, 4.5 = 4 bits) and
    2 parts (3 = 32 ch × 3 b + 32 × 2 b, outliers chosen by the first write), calibrated (mean, channel order,
    chosen layout) or not, keys with a pre-RoPE mean (``rope:``, as the engine's calibration leaves them); odd
    contexts across page boundaries, several sequences, gemma3's window of 8."""
    arch, overrides = TQ_CASES[case]
    model = tq_model(arch, **overrides)
    gen = torch.Generator().manual_seed(1)
    kind, _, spec = kv.rpartition(":")
    codec = calibrated_codec(spec, model, gen, pre_rope=kind == "rope") if kind else kv
    contexts = [5, 17, 40]
    meta, blocks = decode_metadata(contexts)
    caches = model.new_caches(blocks, 16, codec)
    decoder = native_decoder(model, caches)  # built before the first write, as the runner builds it
    assert decoder is not None and decoder.spec.layers[0].k_dtype == "turboquant"
    fill_pages(caches, gen)
    compare_native_with_module_path(model, caches, meta, decoder, torch.tensor([3, 50, 7]))


def test_turboquant_channels_chosen_by_the_first_write_reach_the_native_step():
    """Uncalibrated 2-part pages choose their outlier channels on the first write (module path): the decoder
    built before it is not ready until then, and then reads the chosen order, not identity."""
    model = tq_model("llama")
    meta, blocks = decode_metadata([9, 30])
    caches = model.new_caches(blocks, 16, "turboquant3")
    decoder = native_decoder(model, caches)
    assert len(caches[0].keys.parts) == 2 and caches[0].keys.channels is None
    assert not decoder.ready()
    with pytest.raises(RuntimeError, match="outlier"):
        decoder.logits(torch.tensor([1, 2]), meta, torch.arange(2))
    gen = torch.Generator().manual_seed(2)
    fill_pages(caches, gen)
    assert decoder.ready() and decoder.spec.layers[1].k_tq.channels is caches[1].keys.channels
    assert not torch.equal(caches[1].keys.channels, torch.arange(64).expand(2, -1))
    compare_native_with_module_path(model, caches, meta, decoder, torch.tensor([4, 5]))


def test_turboquant_variants_without_a_native_step_say_why():
    model = tq_model("llama")
    assert why_not_native(model, model.new_caches(2, 16, "turboquant3.5")) is None
    assert why_not_native(model, model.new_caches(2, 16, "k=turboquant3,v=turboquant4")) is None
    assert "its attention native" in why_not_native(model, model.new_caches(2, 16, "turboquant_prod3.5"))
    assert why_not_native(model, model.new_caches(2, 16, "k=turboquant3.5,v=int8")) is None  # one side: native too
    assert why_not_native(model, model.new_caches(2, 16, "k=q5_0,v=turboquant4")) is None
    assert "its attention native" in why_not_native(model, model.new_caches(2, 16, "k=turboquant_prod3.5,v=int8"))
    assert why_not_native(model, model.new_caches(2, 16, "k=q8_0,v=q4_0")) is None
    assert why_not_native(model, model.new_caches(2, 16, "k=rot-q8_0,v=q4_0")) is None
    from bytediet.kvcache import get_kv_codec

    codec = get_kv_codec("turboquant3.5", torch.float32)
    k = torch.randn(64, 2, 64)
    codec.key_half.calibrate(k, 0, positions=torch.arange(64), rope=model.model.layers[0].self_attn.rope)
    codec.key_half.calibrate(k, 1, positions=torch.arange(64), rope=model.model.layers[1].self_attn.rope)
    assert why_not_native(model, model.new_caches(2, 16, codec)) is None  # a pre-RoPE key mean runs natively


def test_an_auto_plan_steps_natively_where_every_layer_is_readable():
    """An ``auto:`` plan's layers each have their own page types: llama.cpp blocks of any k/v mix, turboquant on
    both sides or on one side beside row or block pages (the plans' favourite, k=q5_0,v=turboquant4) all run in
    the native step; a layer whose codes the step does not write (turboquant_prod keys) keeps the model on the
    module path (its attention still runs natively per layer where the pages allow: ``attend_natively``)."""
    from bytediet.kvcache import get_kv_codec

    model = tq_model("llama")
    for plan, layers in (
        (
            [{"k": "q8_0", "v": "q4_0"}, {"k": "turboquant4", "v": "turboquant3"}],
            [("q8_0", "q4_0"), ("turboquant", None)],
        ),
        (
            [{"k": "q5_0", "v": "turboquant4"}, {"k": "turboquant4", "v": "q4_1"}],
            [("q5_0", "turboquant"), ("turboquant", "q4_1")],
        ),
        ([{"k": "q8_0", "v": "q4_0"}, {"k": "turboquant_prod3.5", "v": "q4_0"}], None),
    ):
        codec = get_kv_codec("auto:6")
        codec.load_calibration_state({"budget": 6.0, "plan": plan})
        caches = model.new_caches(2, 16, codec)
        if layers:
            assert why_not_native(model, caches) is None
            spec = native_decoder(model, caches).spec.layers
            assert [(ls.k_dtype, ls.v_dtype) for ls in spec] == layers
        else:
            assert "turboquant_prod keys" in why_not_native(model, caches)


@pytest.mark.parametrize("case", sorted(TQ_CASES))
@pytest.mark.parametrize(
    "kv", ["k=q5_0,v=turboquant4", "k=int8,v=turboquant3.5", "k=turboquant4,v=q4_0", "k=rot-int8,v=turboquant4"]
)
def test_native_decode_step_on_turboquant_beside_row_pages_equals_module_path(case, kv):
    """TurboQuant on one side, row or block pages on the other (rotated ones too): each side written its own way,
    row keys scored against q, row values summed unrotated; 2-part pages' outlier channels from the first write."""
    arch, overrides = TQ_CASES[case]
    model = tq_model(arch, **overrides)
    gen = torch.Generator().manual_seed(3)
    meta, blocks = decode_metadata([5, 17, 40])
    caches = model.new_caches(blocks, 16, kv)
    decoder = native_decoder(model, caches)
    layer = decoder.spec.layers[0]
    assert "turboquant" in (layer.k_dtype, layer.v_dtype) and (layer.k_tq is None) != (layer.v_tq is None)
    fill_pages(caches, gen)
    compare_native_with_module_path(model, caches, meta, decoder, torch.tensor([3, 50, 7]), codec_read=True)


@pytest.fixture(scope="module")
def smollm2_packed():
    from bytediet.models.loader import load_model

    model, tokenizer = load_model("default", keep_packed=True)
    return model, tokenizer


@pytest.mark.parametrize("calibrated", [False, True])
def test_native_turboquant_step_on_the_default_model_equals_module_path(smollm2_packed, calibrated):
    """SmolLM2-135M (30 layers, 9:3 heads, head dim 64) with turboquant3.5 KV, uncalibrated or calibrated on real
    text as ``optimize`` and run configs do (pre-RoPE key means, value means, outliers): a 300-token prefill of
    real text on the module path, then one decode step of two sequences natively and on the module path."""
    from bytediet.eval.corpus import load_corpus
    from bytediet.eval.harness import calibrated_kv_codec

    model, tokenizer = smollm2_packed
    ids = tokenizer.encode(load_corpus("prideprejudice")[5000:9000])[:301]
    contexts = [301, 157]
    meta, blocks = decode_metadata(contexts)
    codec = "turboquant3.5"
    if calibrated:
        codec = calibrated_kv_codec(
            codec, model, tokenizer, {"corpus": "prideprejudice", "windows": 1, "window_len": 256, "seed": 0}
        )
        assert codec.key_half.rope_means  # the case that used to fall back to the module path
    caches = model.new_caches(blocks, 16, codec)
    decoder = native_decoder(model, caches)
    assert decoder is not None
    for s, n in enumerate(contexts):  # each sequence's prompt, prefilled on the module path into its own pages
        pre = AttentionMetadata.for_single_sequence(n - 1, 16, first_block=int(meta.block_tables[s, 0]))
        pre.seq_ids = [s]
        model(torch.tensor(ids[: n - 1]), pre, caches)
    compare_native_with_module_path(model, caches, meta, decoder, torch.tensor([ids[300], ids[156]]), tol=5e-3)


def test_engine_decodes_natively_on_turboquant_after_a_one_token_prompt():
    """A one-token prompt is a step where every sequence has one token: with uncalibrated 2-part pages and no
    channel order yet, the runner sends it down the module path (which picks the order), then decodes natively."""
    from bytediet.engine.llm import LLM
    from bytediet.engine.params import SamplingParams

    model = tq_model("llama")
    llm = LLM(loaded=(model, None), num_blocks=32, block_size=16, kv_cache_dtype="turboquant3")
    runner = llm.engine.runner
    assert runner.decode_path == "native" and not runner.decoder.ready()
    out = llm.generate([[5]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6 and runner.decoder.ready()
    assert runner.decoder.spec.layers[0].k_tq.channels is runner.caches[0].keys.channels is not None


def test_turboquant_prod_without_mse_codes_says_its_attention_is_the_codecs_own_read():
    """turboquant_prod2.5 at head dim 32 keeps no MSE codes (0 + the 1-bit residual): no native reader, said so."""
    from bytediet.kvcache import get_kv_codec

    keys = get_kv_codec("turboquant_prod2.5", torch.float32).create_cache(0, 4, 16, 2, 32, torch.float32, "cpu").keys
    assert "the codec's own read" in keys.step_objection()
    assert keys.native_pages() is None
