"""The native decode step against its twin, the write and the attention apart, each on identical inputs.

A float rounding apart (another summation order: the twin's GEMMs run in MKL, whose order depends on the CPU and
the thread count) a value on a quantization boundary rounds to another code: a KV code of the new token, a
TurboQuant cell, an int8 activation code. So the step is never compared with a twin that wrote its own pages:
- the write: the k, v the native step computes (:func:`native_kv`) written the reference's way equal what the step
  wrote (:func:`assert_written_as_reference`);
- the attention and the rest of the step: the twin reads the pages the step wrote (:func:`twin_on_pages`).
"""

import dataclasses
from unittest import mock

import torch

from bytediet.kernels import ops, reference, turboquant_pages
from bytediet.kernels.decoder_spec import TurboQuantPageSpec, TurboQuantPart

BLOCK = 16


def layer_pages(layer) -> list[torch.Tensor]:
    """The tensors the step writes in a layer, slot first: row or block pages and their scales, TurboQuant norms
    and codes."""
    out = [t for t in (layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale) if t is not None]
    return out + [
        t for pages in (layer.k_tq, layer.v_tq) if pages is not None for p in pages.parts for t in (p.norm, p.idx)
    ]


def snapshot(spec) -> list[list[torch.Tensor]]:
    return [[t.clone() for t in layer_pages(layer)] for layer in spec.layers]


def restore(spec, saved) -> None:
    for layer, tensors in zip(spec.layers, saved):
        for t, s in zip(layer_pages(layer), tensors):
            t.copy_(s)


def native_kv(spec, x, positions, slots, block_tables, variant) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the new tokens' k, v (T, Hkv, D) exactly as the native step computes them (after RoPE and any
    rotation, as they go to the pages): the step rerun once per layer i, layer i's pages swapped for fp32 ones and
    the layers below it as they are, so layer i sees the step's own input. Leaves the pages as they were."""
    saved = snapshot(spec)
    shape = ((int(block_tables.max()) + 1) * BLOCK, spec.num_kv_heads, spec.head_dim)
    kv = []
    for i, layer in enumerate(spec.layers):
        probe = dataclasses.replace(
            layer,
            k_dtype="fp32",
            v_dtype=None,
            k_cache=torch.zeros(shape),
            v_cache=torch.zeros(shape),
            k_scale=None,
            v_scale=None,
            k_tq=None,
            v_tq=None,
        )
        step = dataclasses.replace(spec, layers=[*spec.layers[:i], probe], native=None)
        ops.decode_step(step, x, positions, slots, block_tables, BLOCK, variant=variant)
        kv.append((probe.k_cache[slots].clone(), probe.v_cache[slots].clone()))
        restore(spec, saved)
    return kv


def twin_on_pages(spec, x, positions, slots, block_tables, activations=None):
    """The twin over the pages as they are (the native step's), its own write of the new tokens recorded, not done
    → (out (T, hidden), per layer its (k, v) (T, Hkv, D)); ``activations`` overrides the spec's."""
    kv = []
    twin = spec if activations is None else dataclasses.replace(spec, activations=activations, native=None)
    record = lambda _layer, _slots, k, v, _pos: kv.append((k.clone(), v.clone()))
    with mock.patch.object(reference, "_write_pages", record):
        out = reference.decode_step(twin, x, positions, slots, block_tables, BLOCK)
    return out, kv


def cell_margins(pages: TurboQuantPageSpec, x: torch.Tensor, positions=None) -> list[torch.Tensor]:
    """Per part (T, H, dim): how far the twin's u = R·x_p/‖x_p‖ of x (T, H, D) lies from its nearest cell boundary."""
    out = []
    for p, xp in zip(pages.parts, turboquant_pages._split(pages, x.float(), positions)):
        u = (xp / xp.norm(dim=-1, keepdim=True).clamp(min=1e-12)) @ p.rotation.T
        bounds = (p.codebook[1:] + p.codebook[:-1]) / 2
        out.append((u[..., None] - bounds).abs().amin(-1))
    return out


# u of unit vectors summed in another order: |Δu| ≤ ~2·dim·2⁻²⁴ each side (1.5e-5 at dim 64); a code may flip only
# where u lies that close to a cell boundary
CELL_EPS = 1e-4


def assert_same_codes(got: TurboQuantPageSpec, want: TurboQuantPageSpec, slots, margins) -> None:
    """TurboQuant rows of ``slots`` written from the same x: norms equal but for one fp16 ulp, codes equal but for
    one-step flips where the twin's u lies within CELL_EPS of a cell boundary (``margins``: :func:`cell_margins`)."""
    for g, w, m in zip(got.parts, want.parts, margins):
        # ‖x_p‖ summed in another order, then rounded to fp16: one ulp (≤ 2⁻¹⁰ relative) where it sits on a midpoint
        assert torch.allclose(g.norm[slots].float(), w.norm[slots].float(), rtol=2**-10, atol=0)
        a, b = (turboquant_pages.unpack_codes(p.idx[slots], p.bits, p.dim) for p in (g, w))
        flipped = a != b
        assert (a - b).abs().max().item() <= 1 and (m[flipped] < CELL_EPS).all()


def _twin_tq(pages: TurboQuantPageSpec) -> TurboQuantPageSpec:
    return TurboQuantPageSpec(
        [TurboQuantPart(p.dim, p.bits, p.rotation, p.codebook, p.norm.clone(), p.idx.clone()) for p in pages.parts],
        pages.channels,
        pages.mean,
        pages.rope_mean,
        pages.inv_freq,
    )


def assert_written_as_reference(spec, before, kv, positions, slots) -> None:
    """The pages hold, in ``slots``, the native k, v (``kv``, per layer) as the reference writes them — bit for bit
    for row and block pages (kv_pages.h's encoders are the reference's float steps: test_ops_read_kv_rows), as
    :func:`assert_same_codes` for TurboQuant's — and every other slot as it was (``before``)."""
    for layer, old, (k, v) in zip(spec.layers, before, kv):
        for (dtype, pages, scales, tq), x in zip(reference._sides(layer), (k, v)):
            if dtype == "turboquant":
                twin = _twin_tq(tq)
                reference.turboquant_write(twin, x, slots, positions)
                assert_same_codes(tq, twin, slots, cell_margins(tq, x, positions))
                continue
            rows, row_scales = reference.write_kv_rows(dtype, x)
            assert torch.equal(pages[slots], rows)
            if row_scales is not None:
                assert torch.equal(scales[slots], row_scales.reshape(scales[slots].shape))
        untouched = torch.ones(layer_pages(layer)[0].shape[0], dtype=torch.bool)
        untouched[slots] = False
        for t, b in zip(layer_pages(layer), old):
            assert torch.equal(t[untouched], b[untouched])
