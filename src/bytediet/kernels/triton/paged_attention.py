"""Paged attention in Triton over every row, block and TurboQuant page type: the GPU twin of
:func:`bytediet.kernels.reference.attention_over_pages` (flash-decoding split-K for decodes, a FlashAttention tile
loop for prefill chunks over pages; the kernels are in :mod:`.paged_attention_kernels`).

Rotated pages (``rot-int8``, ``rot-q8_0``) are int8 / q8_0 pages here: the caller rotates the query and the output
(:meth:`bytediet.kvcache.compressed.CompressedCache.attend_natively`), as for the native kernel. Code pages (KIVI,
HF QuantizedCache, QJL, PolarQuant) have no Triton kernel: they raise NotImplementedError.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..decoder_spec import BLOCK_PAGE_TYPES, CODE_PAGE_TYPES, FLOAT_PAGE_DTYPES, KV_PAGE_TYPES, TurboQuantPageSpec
from .runtime import available, interpreting

__all__ = ["attention_over_pages", "available", "check_pages"]

TRITON_PAGE_TYPES = tuple(FLOAT_PAGE_DTYPES) + ("int8", "fp8") + tuple(BLOCK_PAGE_TYPES) + ("turboquant",)


def check_pages(k_dtype: str, v_dtype: Optional[str] = None, k_side=None, v_side=None) -> None:
    """Raise a one-line NotImplementedError (a page type or TurboQuant layout without a Triton kernel) or ValueError
    (an unknown page type) unless the kernel reads these pages: for a caller to check once, before the first step."""
    v_dtype = v_dtype or k_dtype
    for dtype in (k_dtype, v_dtype):
        if dtype in CODE_PAGE_TYPES:
            raise NotImplementedError(
                f"the Triton paged attention has no kernel for {dtype!r} pages; "
                f"use a KV cache of {', '.join(TRITON_PAGE_TYPES)}"
            )
        if dtype not in TRITON_PAGE_TYPES:
            raise ValueError(f"unknown KV page type {dtype!r}; choose one of: {', '.join(TRITON_PAGE_TYPES)}")
    if k_dtype == "turboquant":
        parts = _parts(k_side, "keys")
        if any((p.signs is None) != (parts[0].signs is None) for p in parts):
            raise NotImplementedError(
                "the Triton paged attention reads TurboQuant keys whose parts are all MSE or all inner-product"
            )
    if v_dtype == "turboquant":
        parts = _parts(v_side, "values")
        if parts[0].signs is not None or v_side.rope_mean is not None:
            raise NotImplementedError(
                "the Triton paged attention reads TurboQuant values of the MSE variant without a pre-RoPE mean"
            )


def attention_over_pages(
    q: torch.Tensor,
    positions: torch.Tensor,
    token_rows: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    scale: float,
    window: Optional[int],
    k_dtype: str,
    k_cache: Optional[torch.Tensor],
    v_cache: Optional[torch.Tensor],
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    v_dtype: Optional[str] = None,
    k_side=None,
    v_side=None,
    *,
    num_splits: Optional[int] = None,
    block_m: Optional[int] = None,
    precision: Optional[str] = None,
) -> torch.Tensor:
    """See :func:`bytediet.kernels.reference.attention_over_pages`: q (T, Hq, D) → (T, Hq, D) float32, on q's device
    (CUDA, or the CPU under TRITON_INTERPRET=1). Tokens with one query per block-table row run as decodes (the
    context split over programs, then merged); otherwise tiles of a row's tokens share each page read. The tiling is
    chosen unless given (tests): ``block_m`` tokens a tile, the context of each cut into ``num_splits`` slices;
    ``precision`` the float32 dots' (tl.dot's input_precision: "ieee" in the interpreter, else "tf32")."""
    v_dtype = v_dtype or k_dtype
    check_pages(k_dtype, v_dtype, k_side, v_side)
    from . import paged_attention_kernels as K  # triton only now

    t, hq, d = q.shape
    hkv = (k_side.parts[0].norm if k_dtype == "turboquant" else k_cache).shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
    g = hq // hkv
    out = torch.empty(t, hq, d, dtype=torch.float32, device=q.device)
    if t == 0:
        return out
    qf = q.float()
    positions, token_rows = positions.to(torch.int32).contiguous(), token_rows.to(torch.int32).contiguous()
    block_tables = block_tables.contiguous()
    dummy = qf  # a pointer for the arguments a page type does not use

    kq, qx, ra, rb, invf = _key_query(k_dtype, k_side, qf, hkv, dummy)
    k_args, k_const = _side_args(k_dtype, k_cache, k_scale, k_side, dummy, keys=True)
    v_args, v_const = _side_args(v_dtype, v_cache, v_scale, v_side, dummy, keys=False)

    tq = "turboquant" in (k_dtype, v_dtype)
    cfg = tiling(t <= block_tables.shape[0], g, d, tq, block_m)
    block_m, dp = cfg["BLOCK_M"], max(16, triton_next_pow2(d))
    tiles = -(-t // block_m)
    if num_splits is None:
        num_splits = _splits(q, tiles * hkv, block_tables.shape[1] * block_size) if block_m == 1 else 1
    part = out if num_splits == 1 else torch.empty(t, hq, num_splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(t, hq, num_splits, dtype=torch.float32, device=q.device)
    half = d // 2
    K._attn_kernel[(tiles, hkv, num_splits)](
        kq,
        qx,
        ra,
        rb,
        invf,
        positions,
        token_rows,
        block_tables,
        block_tables.stride(0),
        block_size,
        t,
        hq,
        hkv,
        g,
        int(window or 0),
        scale * 1.4426950408889634,
        d,
        part,
        lse,
        *k_args,
        *v_args,
        KT=KV_PAGE_TYPES.index(k_dtype),
        VT=KV_PAGE_TYPES.index(v_dtype),
        DP=dp,
        HALF=half,
        HP=max(16, triton_next_pow2(half)),
        **k_const,
        **v_const,
        **cfg,
        SPLITS=num_splits,
        DOT_PREC=precision or ("ieee" if interpreting() else "tf32"),
    )
    if num_splits > 1:
        K._merge_kernel[(t * hq,)](part, lse, out, d, SPLITS=num_splits, SP=triton_next_pow2(num_splits), DP=dp)
    return _value_output(v_dtype, v_side, out, hkv) if v_dtype == "turboquant" else out


def tiling(decode: bool, g: int, d: int, turboquant: bool, block_m: Optional[int] = None) -> dict:
    """The kernel's tile: BLOCK_M tokens × G_PAD query heads (rows, ≥ 16 for tl.dot), BLOCK_N keys a step, warps.
    Decodes take one token a program; prefill tiles 64 rows (32 over TurboQuant pages, whose dots stage more
    operands in shared memory); 32 keys a step for head_dim > 128, TurboQuant pages and the interpreter."""
    gp = triton_next_pow2(g)
    if block_m is None:
        block_m = 1 if decode else max(1, (32 if turboquant else 64) // gp)
    wide = d > 128 or turboquant or interpreting()
    return {
        "BLOCK_M": block_m,
        "G_PAD": max(gp, 16 // block_m),
        "BLOCK_N": 32 if wide else 64,
        "num_warps": 4 if block_m == 1 else 8,
    }


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _splits(q: torch.Tensor, programs: int, capacity: int) -> int:
    """Slices of each decode's context: enough programs to fill the GPU twice, each slice ≥ 256 keys, at most 32."""
    if not q.is_cuda:
        return 1
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    want = triton_next_pow2(max(1, -(-2 * sms // programs)))
    return max(1, min(want, 32, triton_next_pow2(max(1, capacity // 256))))


def _parts(spec: TurboQuantPageSpec, what: str):
    """Check the parts of TurboQuant pages the kernel reads (1 or 2 parts, 1–8 MSE bits, whole bytes a row)."""
    if not 1 <= len(spec.parts) <= 2:
        raise NotImplementedError(
            f"the Triton paged attention reads TurboQuant {what} of 1 or 2 parts, not {len(spec.parts)}"
        )
    for p in spec.parts:
        if not 1 <= p.bits <= 8 or p.dim * p.bits % 8 or p.dim % 8:
            raise NotImplementedError(
                f"the Triton paged attention reads TurboQuant {what} of 1-8 bits a code and "
                f"whole-byte rows, not a part of {p.dim} channels at {p.bits} bits"
            )
    return spec.parts


def _key_query(k_dtype, spec, qf, hkv, dummy):
    """(query the kernel scores, its QJL sketch, RoPE-mean coefficients a and b, inv_freq): for TurboQuant keys the
    query in the stored channel order, each part rotated once (q̃ = q_p R_pᵀ) and sketched (q̃ Sᵀ) for inner-product
    keys; a pre-RoPE mean μ adds q·RoPE(μ, p) = Σ_i a_i cos(p θ_i) + b_i sin(p θ_i), with a = q₁μ₁ + q₂μ₂ and
    b = q₂μ₁ − q₁μ₂. A constant mean adds q·μ to every score of a query: the softmax ignores it."""
    if k_dtype != "turboquant":
        return qf.contiguous(), dummy, dummy, dummy, dummy
    parts = spec.parts
    t, hq, d = qf.shape
    qg = qf.view(t, hkv, hq // hkv, d)
    qs = qg if spec.channels is None else torch.gather(qg, -1, spec.channels[None, :, None, :].expand_as(qg))
    rot, sk = [], []
    for p, qp in zip(parts, torch.split(qs, [p.dim for p in parts], dim=-1)):
        qr = qp @ p.rotation.T
        rot.append(qr)
        sk.append(qr @ p.sketch.T if p.signs is not None else qr)
    kq = torch.cat(rot, -1).reshape(t, hq, d).contiguous()
    prod = parts[0].signs is not None
    qx = torch.cat(sk, -1).reshape(t, hq, d).contiguous() if prod else dummy
    if spec.rope_mean is None:
        return kq, qx, dummy, dummy, dummy
    m1, m2 = spec.rope_mean.float()[None, :, None, :].chunk(2, dim=-1)  # (1, Hkv, 1, D/2)
    q1, q2 = qg.chunk(2, dim=-1)
    ra = (q1 * m1 + q2 * m2).reshape(t, hq, d // 2).contiguous()
    rb = (q2 * m1 - q1 * m2).reshape(t, hq, d // 2).contiguous()
    return kq, qx, ra, rb, spec.inv_freq.float().contiguous()


def _side_args(dtype, pages, scales, spec, dummy, keys: bool):
    """The kernel's pointer and stride arguments for one side (keys or values), and its constexprs."""
    pre = "K_" if keys else "V_"
    if dtype != "turboquant":
        if pages.stride(-1) != 1:
            raise ValueError("Triton paged attention reads pages whose rows are contiguous (stride 1 in the last dim)")
        s = dummy if scales is None else scales
        s_strides = (s.stride(0), s.stride(1)) if scales is not None else (0, 0)
        args = [pages, s, pages.stride(0), pages.stride(1), *s_strides]
        args += [dummy] * (10 if keys else 6)
        const = {
            pre + "NP": 1,
            pre + "D0": 0,
            pre + "D1": 0,
            pre + "B0": 8,
            pre + "B1": 8,
            pre + "P0": 16,
            pre + "P1": 16,
        }
        if keys:
            const.update(K_PROD=False, K_ROPE=False)
        return args, const
    parts = spec.parts
    for p in parts:
        if not (p.idx.is_contiguous() and p.norm.is_contiguous()):
            raise ValueError("TurboQuant pages (norm, idx) must be contiguous")
    args = [dummy, dummy, 0, 0, 0, 0]
    for i in range(2):
        p = parts[min(i, len(parts) - 1)]
        args += [p.idx, p.norm, p.codebook]
        if keys:
            args += [dummy, dummy] if p.signs is None else [p.signs.contiguous(), p.res_norm.contiguous()]
    p0, p1 = parts[0], parts[-1]
    const = {
        pre + "NP": len(parts),
        pre + "D0": p0.dim,
        pre + "D1": p1.dim if len(parts) == 2 else 0,
        pre + "B0": p0.bits,
        pre + "B1": p1.bits,
        pre + "P0": max(16, triton_next_pow2(p0.dim)),
        pre + "P1": max(16, triton_next_pow2(p1.dim)) if len(parts) == 2 else 16,
    }
    if keys:
        const.update(K_PROD=p0.signs is not None, K_ROPE=spec.rope_mean is not None)
    return args, const


def _value_output(v_dtype, spec, out, hkv) -> torch.Tensor:
    """The kernel's output over TurboQuant values (each part's Σ p ‖v‖ c[idx] in its rotated basis) → the model's
    basis: every part rotated back once (· R_p), the channels put back in place, the mean added."""
    t, hq, d = out.shape
    parts = spec.parts
    x = torch.cat([o @ p.rotation for p, o in zip(parts, torch.split(out, [p.dim for p in parts], dim=-1))], -1)
    x = x.view(t, hkv, hq // hkv, d)
    if spec.channels is not None:
        x = torch.empty_like(x).scatter_(-1, spec.channels[None, :, None, :].expand_as(x), x)
    if spec.mean is not None:
        x = x + spec.mean.float()[None, :, None, :]
    return x.reshape(t, hq, d)
