"""The native decode step refuses, through the Python boundary, a layer whose pages it cannot read or write — code
pages, a head_dim its block pages do not fit, int8 pages without their scales — with an error and no work done
(before the fix it skipped the layer's attention and used the previous layer's output)."""

import pytest
import torch
from gguf import GGMLQuantizationType as T

from bytediet.kernels import ops, reference
from bytediet.kernels.cpu import build
from bytediet.kernels.decoder_spec import DecoderSpec, LayerSpec, LinearSpec
from bytediet.kernels.ggml_codecs import ENCODERS

VARIANTS = [v.name for v in build.runnable_variants()] if build.find_compiler() else []
pytestmark = pytest.mark.skipif(not VARIANTS, reason="no native kernels on this machine")
SLOTS, BLOCK, HIDDEN, HEADS = 64, 16, 64, 2


def linear(n, k, gen):
    return LinearSpec(
        ENCODERS[T.Q8_0](torch.randn(n * k // 32, 32, generator=gen) * 0.2).reshape(n, -1), int(T.Q8_0), n, k
    )


def spec(k_dtype, head_dim, with_scales=True):
    gen = torch.Generator().manual_seed(0)
    if k_dtype == "kivi2-keys":  # code pages: 2-bit codes, read by the attention with side data only
        pages, scales = torch.randint(0, 256, (SLOTS, 1, head_dim // 4), dtype=torch.uint8, generator=gen), None
    else:
        pages, scales = reference.write_kv_rows(k_dtype, torch.randn(SLOTS, 1, head_dim, generator=gen))
    layer = LayerSpec(
        attn_norm=torch.ones(HIDDEN),
        post_attn_norm=torch.ones(HIDDEN),
        inv_freq=1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)),
        k_cache=pages,
        v_cache=pages.clone(),
        k_dtype=k_dtype,
        k_scale=scales if with_scales else None,
        v_scale=scales if with_scales else None,
        q=linear(HEADS * head_dim, HIDDEN, gen),
        k=linear(head_dim, HIDDEN, gen),
        v=linear(head_dim, HIDDEN, gen),
        o=linear(HIDDEN, HEADS * head_dim, gen),
        gate=linear(96, HIDDEN, gen),
        up=linear(96, HIDDEN, gen),
        down=linear(HIDDEN, 96, gen),
    )
    return DecoderSpec(
        layers=[layer],
        hidden=HIDDEN,
        intermediate=96,
        num_heads=HEADS,
        num_kv_heads=1,
        head_dim=head_dim,
        eps=1e-6,
        attention_scale=head_dim**-0.5,
        gelu=False,
        sandwich=False,
    )


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "k_dtype,head_dim,with_scales,status",
    [
        ("kivi2-keys", 32, True, "unsupported pages"),  # code pages: the attention reads them, the step does not
        ("q8_0", 48, True, "unsupported pages"),  # GGML block pages need head_dim a multiple of 32
        ("int8", 32, False, "missing pages"),  # int8 pages keep a scale per row
    ],
)
def test_decode_step_refuses_pages_it_cannot_read(variant, k_dtype, head_dim, with_scales, status):
    s = spec(k_dtype, head_dim, with_scales)
    x = torch.randn(1, HIDDEN)
    k_before = s.layers[0].k_cache.clone()
    bt = torch.arange(SLOTS // BLOCK).reshape(1, -1)
    with pytest.raises(ops.NativeKernelError, match=f"refused its layers' pages \\({status}\\).*{k_dtype}"):
        ops.decode_step(s, x, torch.tensor([5]), torch.tensor([5]), bt, BLOCK, variant=variant)
    assert torch.equal(s.layers[0].k_cache, k_before)  # no work done: the new key was not written


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_same_layer_with_pages_it_reads_runs(variant):
    s = spec("int8", 32)
    out = ops.decode_step(
        s,
        torch.randn(1, HIDDEN),
        torch.tensor([5]),
        torch.tensor([5]),
        torch.arange(SLOTS // BLOCK).reshape(1, -1),
        BLOCK,
        variant=variant,
    )
    assert out.shape == (1, HIDDEN) and torch.isfinite(out).all()
