"""Random batches and KV pages shared by the paged-attention tests (native and Triton)."""

import torch

from bytediet.kernels import reference
from bytediet.kernels.decoder_spec import TurboQuantPageSpec, TurboQuantPart
from bytediet.kernels.triton.paged_attention_check import BLOCK, ragged_batch
from bytediet.kvcache.turboquant_core import TurboQuantizer

__all__ = ["BLOCK", "ragged_batch", "row_pages", "turboquant_pages"]


def row_pages(gen, slots, hkv, d, page_type):
    """(pages, scales): random keys or values as the KV codecs store them in ``page_type``."""
    return reference.write_kv_rows(page_type, torch.randn(slots, hkv, d, generator=gen) * 2)


def turboquant_pages(gen, slots, hkv, d, layout, variant="mse", calibrated=None, seed=5):
    """Random TurboQuant codes of ``layout`` [(channels, MSE bits), …] (the inner-product variant adds a sign bit a
    channel), part i's rotation seeded ``seed + i``; ``calibrated``: a channel order, and a constant mean or
    ("rope") a pre-RoPE mean with the layer's frequencies."""
    parts = []
    prod = variant == "prod"
    for i, (n, b) in enumerate(layout):
        tq = TurboQuantizer(n, b + prod, variant, "hadamard" if i == 0 else "qr", seed + i)
        parts.append(
            TurboQuantPart(
                n,
                b,
                tq.R,
                tq.codebook,
                (torch.rand(slots, hkv, generator=gen) * 3 + 0.1).half(),
                torch.randint(0, 256, (slots, hkv, n * b // 8), generator=gen, dtype=torch.uint8),
                torch.randint(0, 256, (slots, hkv, n // 8), generator=gen, dtype=torch.uint8) if prod else None,
                (torch.rand(slots, hkv, generator=gen) * 0.6).half() if prod else None,
                tq.S,
            )
        )
    channels = mean = rope_mean = inv_freq = None
    if calibrated:
        channels = torch.stack([torch.randperm(d, generator=gen) for _ in range(hkv)])
        mu = torch.randn(hkv, d, generator=gen) * 2
        if calibrated == "rope":
            rope_mean, inv_freq = mu, 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
        else:
            mean = mu
    return TurboQuantPageSpec(parts, channels, mean, rope_mean, inv_freq)
