"""TurboQuant pages in the native decode step (csrc/turboquant_pages.cpp) against their PyTorch twin
(kernels/turboquant_pages.py via reference.decode_step): attention on codes for 1- and 2-part layouts of every
bit width 1–8, with and without a calibrated mean and channel order, every GQA ratio of the three families
(1:1, SmolLM2's 3:1, Gemma-3's 4:1 with a sliding window, Qwen2's 7:1), odd contexts across page boundaries,
several sequences at once; and the codes the step writes for the new token."""

import zlib

import pytest
import torch

from bytediet.kernels import ops, reference, turboquant_pages
from bytediet.kernels.decoder_spec import TurboQuantPageSpec, TurboQuantPart
from bytediet.kvcache.turboquant_core import TurboQuantizer
from tests.kernels.step_checks import assert_same_codes, cell_margins
from tests.kernels.test_ops_decode_step import VARIANTS, batch, check_step, random_spec

pytestmark = pytest.mark.skipif(not VARIANTS, reason="no native kernels on this machine")


def tq_pages(gen, slots, kv_heads, head_dim, layout, calibrated, seed, inv_freq=None):
    """Random earlier tokens written into TurboQuant pages of ``layout`` [(channels, bits), …]; ``calibrated``:
    False, True (channel order and a constant mean) or "rope" (channel order and, given the layer's ``inv_freq``,
    a pre-RoPE mean: calibrated keys)."""
    parts = []
    for i, (n, b) in enumerate(layout):
        q = TurboQuantizer(n, b, "mse", "hadamard" if i == 0 else "qr", seed + 17 * i)
        parts.append(
            TurboQuantPart(
                n,
                b,
                q.R,
                q.codebook,
                torch.zeros(slots, kv_heads, dtype=torch.float16),
                torch.zeros(slots, kv_heads, n * b // 8, dtype=torch.uint8),
            )
        )
    channels = mean = rope_mean = None
    if calibrated:
        channels = torch.stack([torch.randperm(head_dim, generator=gen) for _ in range(kv_heads)])
        mu = torch.randn(kv_heads, head_dim, generator=gen) * 2
        mean, rope_mean = (None, mu) if calibrated == "rope" and inv_freq is not None else (mu, None)
    pages = TurboQuantPageSpec(parts, channels, mean, rope_mean, None if rope_mean is None else inv_freq)
    x = torch.randn(slots, kv_heads, head_dim, generator=gen) * (1 + torch.rand(head_dim, generator=gen) * 3)
    positions = torch.randperm(slots, generator=gen)  # any position per slot: reads add RoPE(μ, p) of theirs
    turboquant_pages.write(pages, x + (0 if mean is None else mean), torch.arange(slots), positions)
    return pages


def tq_spec(gen, layout, calibrated, **kwargs):
    spec = random_spec(gen, **kwargs)
    for i, layer in enumerate(spec.layers):
        layer.k_dtype, layer.k_cache, layer.v_cache = "turboquant", None, None
        layer.k_tq = tq_pages(gen, 512, spec.num_kv_heads, spec.head_dim, layout, calibrated, 100 * i, layer.inv_freq)
        layer.v_tq = tq_pages(gen, 512, spec.num_kv_heads, spec.head_dim, layout[::-1], calibrated, 100 * i + 7)
    return spec


CASES = {  # name: (spec kwargs, contexts)
    "mha": (dict(heads=4, kv_heads=4), [1, 17, 32]),
    "smollm2-gqa-3": (dict(heads=6, kv_heads=2, head_dim=64), [33, 150, 5]),
    "gemma3-gqa-4-window": (dict(heads=4, kv_heads=1, gemma=True, window=20, head_dim=64), [16, 47, 130]),
    "qwen2-gqa-7": (dict(heads=7, kv_heads=1, bias=True), [64, 3, 257]),
}
LAYOUTS = {  # head dim 32 / 64: plain b bits, and outlier splits covering 1–8 bits per part
    "3": ([(32, 3)], [(64, 3)]),
    "4": ([(32, 4)], [(64, 4)]),
    "4+3": ([(8, 4), (24, 3)], [(32, 4), (32, 3)]),
    "2+1": ([(16, 2), (16, 1)], [(16, 2), (48, 1)]),
    "6+5": ([(8, 6), (24, 5)], [(16, 6), (48, 5)]),
    "8+7": ([(8, 8), (24, 7)], [(8, 8), (56, 7)]),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("calibrated", [False, True, "rope"])
def test_decode_step_on_turboquant_pages_equals_reference(variant, case, layout, calibrated):
    kwargs, contexts = CASES[case]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}{layout}{calibrated}".encode()))
    lay = LAYOUTS[layout][kwargs.get("head_dim", 32) == 64]
    if not calibrated and len(lay) > 1 and case != "mha":
        pytest.skip("two parts without a channel order: covered by the calibrated run and the mha case")
    if calibrated == "rope" and layout not in ("3", "4+3"):
        pytest.skip("the pre-RoPE mean's score term does not depend on the layout: two layouts are enough")
    # q16 activations: the step is compared on identical pages (check_step), and q16 holds each activation within
    # amax/64516 whichever way a code rounds — with q8 one flipped code (x/d = −48.50003 in mha-3) re-draws the
    # int8 rounding of all that follows (1.6e-2 of the max)
    spec = tq_spec(gen, lay, calibrated, activations="q16", **kwargs)
    check_step(spec, *batch(gen, contexts), torch.randn(len(contexts), spec.hidden, generator=gen), variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "layout", [[(64, 3)], [(32, 4), (32, 3)], [(16, 8), (48, 2)], [(8, 5), (56, 1)], [(24, 6), (40, 7)]]
)
@pytest.mark.parametrize("calibrated", [False, True, "rope"])
def test_native_write_equals_reference(variant, layout, calibrated):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{layout}{calibrated}".encode()))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64)
    pages = tq_pages(gen, 64, 3, 64, layout, calibrated, 5, inv_freq)
    twin = TurboQuantPageSpec(
        [TurboQuantPart(p.dim, p.bits, p.rotation, p.codebook, p.norm.clone(), p.idx.clone()) for p in pages.parts],
        pages.channels,
        pages.mean,
        pages.rope_mean,
        pages.inv_freq,
    )
    x = torch.randn(40, 3, 64, generator=gen) * torch.logspace(-3, 3, 40)[:, None, None]  # extreme scales
    x[0] = 0.0  # a zero vector: norm 0, u = 0
    slots = torch.randperm(64, generator=gen)[:40]
    positions = torch.randint(0, 9000, (40,), generator=gen)  # up to long contexts: the angles p·θ_i grow
    ops.turboquant_write(pages, x, slots, positions, variant=variant)
    reference.turboquant_write(twin, x, slots, positions)
    assert_same_codes(pages, twin, slots, cell_margins(twin, x, positions))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("k_dtype,v_dtype", [("q5_0", "turboquant"), ("int8", "turboquant"), ("turboquant", "q4_0")])
def test_decode_step_on_turboquant_beside_row_pages_equals_reference(variant, case, k_dtype, v_dtype):
    """One side TurboQuant, the other row or block pages (an auto:<bits> plan's k=q5_0,v=turboquant4): the step
    writes each side its own way and attends with row keys against q itself or row values summed unrotated."""
    kwargs, contexts = CASES[case]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}{k_dtype}{v_dtype}".encode()))
    rows_dtype = v_dtype if k_dtype == "turboquant" else k_dtype
    spec = random_spec(gen, activations="q16", k_dtype=rows_dtype, **kwargs)
    d = spec.head_dim
    for i, layer in enumerate(spec.layers):
        pages = tq_pages(gen, 512, spec.num_kv_heads, d, [(8, 4), (d - 8, 3)], True, 100 * i)
        layer.k_dtype, layer.v_dtype = k_dtype, v_dtype
        if k_dtype == "turboquant":
            layer.k_cache, layer.k_scale, layer.k_tq = None, None, pages
        else:
            layer.v_cache, layer.v_scale, layer.v_tq = None, None, pages
    check_step(spec, *batch(gen, contexts), torch.randn(len(contexts), spec.hidden, generator=gen), variant)
