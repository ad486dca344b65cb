"""Triton bodies of the paged attention (imported only by :mod:`.paged_attention`, which prepares their inputs).

One kernel serves decode and prefill: a program takes a tile of BLOCK_M consecutive tokens × the G query heads of
one KV head (rows r = token · G_PAD + g) and one of SPLITS slices of their context (flash-decoding split-K, Dao et
al. 2023; SGLang's ``decode_attention.py``), loops over the tile's block-table rows (a decode tile has one token, a
prefill tile the tokens of one sequence), and over BLOCK_N keys at a time with an online softmax (FlashAttention,
arXiv 2205.14135), causal and within ``window``. Pages are decoded in registers: float rows, int8/fp8 codes with their
fp16 scales, llama.cpp's q8_0/q5_0/q4_1/q4_0 blocks from their bytes, TurboQuant codes scored against the query
rotated once (keys) or summed in the rotated basis (values). ``_merge_kernel`` merges the slices (stage 2).

Every ``tl.dot`` takes float32 operands (the interpreter's bf16 dot is wrong); DOT_PREC is "ieee" in the interpreter.
Page type ids are :data:`bytediet.kernels.decoder_spec.KV_PAGE_TYPES` indices.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..decoder_spec import KV_PAGE_TYPES

# page type ids: their indices in decoder_spec.KV_PAGE_TYPES
FP32, BF16, FP16, INT8, FP8, TURBOQUANT, Q8_0, Q5_0, Q4_1 = (
    tl.constexpr(KV_PAGE_TYPES.index(n))
    for n in ("fp32", "bf16", "fp16", "int8", "fp8", "turboquant", "q8_0", "q5_0", "q4_1")
)


@triton.jit
def _f16_bytes(ptr, off, mask):
    """Two little-endian bytes at ``off`` → their float16 as float32."""
    lo = tl.load(ptr + off, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + off + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3(code):
    """E4M3 (fn) codes int32 in [0, 255] → float32 (exact; the codecs never store NaN)."""
    e = (code >> 3) & 15
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    x = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where(code >= 128, -x, x)


@triton.jit
def _page_rows(TYPE: tl.constexpr, P, S, slots, head, p_slot, p_head, s_slot, s_head, n_mask, D, DP: tl.constexpr):
    """Rows of row or block pages at ``slots`` (N,) int64 for KV head ``head`` → (N, DP) float32 (0 past D)."""
    cols = tl.arange(0, DP)
    m = n_mask[:, None] & (cols < D)[None, :]
    base = (slots * p_slot + head * p_head)[:, None]
    if TYPE == FP32 or TYPE == BF16 or TYPE == FP16:
        x = tl.load(P + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
    elif TYPE == INT8 or TYPE == FP8:
        code = tl.load(P + base + cols[None, :], mask=m, other=0).to(tl.int32)
        sc = tl.load(S + slots * s_slot + head * s_head, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if TYPE == INT8:
            x = (code - 128).to(tl.float32) * sc
        else:
            x = _e4m3(code) * sc
    else:
        blk = (cols // 32)[None, :]
        j = (cols % 32)[None, :]
        if TYPE == Q8_0:
            b0 = base + blk * 34
            q = tl.load(P + b0 + 2 + j, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            x = q * _f16_bytes(P, b0, m)
        elif TYPE == Q5_0:
            b0 = base + blk * 22
            nib = (tl.load(P + b0 + 6 + (j % 16), mask=m, other=0).to(tl.int32) >> ((j // 16) * 4)) & 15
            hb = (tl.load(P + b0 + 2 + j // 8, mask=m, other=0).to(tl.int32) >> (j % 8)) & 1
            x = _f16_bytes(P, b0, m) * ((nib | (hb << 4)) - 16).to(tl.float32)
        elif TYPE == Q4_1:
            b0 = base + blk * 20
            nib = (tl.load(P + b0 + 4 + (j % 16), mask=m, other=0).to(tl.int32) >> ((j // 16) * 4)) & 15
            x = _f16_bytes(P, b0, m) * nib.to(tl.float32) + _f16_bytes(P, b0 + 2, m)
        else:  # q4_0
            b0 = base + blk * 18
            nib = (tl.load(P + b0 + 2 + (j % 16), mask=m, other=0).to(tl.int32) >> ((j // 16) * 4)) & 15
            x = _f16_bytes(P, b0, m) * (nib - 8).to(tl.float32)
    return x


@triton.jit
def _tq_codes(IDX, CB, rowbase, n_mask, DIM: tl.constexpr, BITS: tl.constexpr, DP: tl.constexpr):
    """TurboQuant codes of a part (``BITS`` a code, packed little-endian, rows at ``rowbase`` (N,)) → their
    centroids (N, DP) float32 (0 past DIM)."""
    cols = tl.arange(0, DP)
    m = n_mask[:, None] & (cols < DIM)[None, :]
    bit = cols * BITS
    byte = (bit >> 3)[None, :]
    nbytes: tl.constexpr = DIM * BITS // 8
    w = tl.load(IDX + rowbase[:, None] + byte, mask=m, other=0).to(tl.int32)
    w |= tl.load(IDX + rowbase[:, None] + byte + 1, mask=m & (byte + 1 < nbytes), other=0).to(tl.int32) << 8
    code = (w >> (bit & 7)[None, :]) & ((1 << BITS) - 1)
    return tl.load(CB + code, mask=m, other=0.0)


@triton.jit
def _tq_signs(SG, rowbase, n_mask, DIM: tl.constexpr, DP: tl.constexpr):
    """QJL sign bits of a part (rows of DIM/8 bytes at ``rowbase``) → ±1 (N, DP) float32 (0 past DIM)."""
    cols = tl.arange(0, DP)
    m = n_mask[:, None] & (cols < DIM)[None, :]
    b = tl.load(SG + rowbase[:, None] + (cols >> 3)[None, :], mask=m, other=0).to(tl.int32)
    s = ((b >> (cols & 7)[None, :]) & 1).to(tl.float32) * 2.0 - 1.0
    return tl.where(m, s, 0.0)


@triton.jit
def _tq_part_scores(
    qp,
    qxp,
    IDX,
    NRM,
    CB,
    SG,
    RES,
    slots,
    head,
    hkv,
    n_mask,
    DIM: tl.constexpr,
    BITS: tl.constexpr,
    DP: tl.constexpr,
    PROD: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Scores (R, N) of the rotated query part ``qp`` (R, DP) against a part of TurboQuant keys: ‖k‖ (q̃·c[idx]
    + √(π/2)/DIM · ‖r‖ · (S q̃)·sign) — the second term for inner-product keys only (``qxp`` = q̃ Sᵀ)."""
    sh = slots * hkv + head
    c = _tq_codes(IDX, CB, sh * (DIM * BITS // 8), n_mask, DIM, BITS, DP)
    s = tl.dot(qp, tl.trans(c), input_precision=DOT_PREC)
    if PROD:
        sg = _tq_signs(SG, sh * (DIM // 8), n_mask, DIM, DP)
        res = tl.load(RES + sh, mask=n_mask, other=0.0).to(tl.float32) * (1.2533141373155001 / DIM)
        s += tl.dot(qxp, tl.trans(sg), input_precision=DOT_PREC) * res[None, :]
    nrm = tl.load(NRM + sh, mask=n_mask, other=0.0).to(tl.float32)
    return s * nrm[None, :]


@triton.jit
def _tq_part_values(
    p,
    IDX,
    NRM,
    CB,
    slots,
    head,
    hkv,
    n_mask,
    DIM: tl.constexpr,
    BITS: tl.constexpr,
    DP: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Σ_j p_j ‖v_j‖ c[idx_j] (R, DP): the weights ``p`` (R, N) over a part of TurboQuant values, rotated basis."""
    sh = slots * hkv + head
    c = _tq_codes(IDX, CB, sh * (DIM * BITS // 8), n_mask, DIM, BITS, DP)
    nrm = tl.load(NRM + sh, mask=n_mask, other=0.0).to(tl.float32)
    return tl.dot(p * nrm[None, :], c, input_precision=DOT_PREC)


@triton.jit
def _attn_kernel(
    Q,
    QX,
    RA,
    RB,
    INVF,
    POS,
    ROWS,
    BT,
    bt_stride,
    block_size,
    T,
    Hq,
    hkv,
    G,
    window,
    qk_scale,
    D,
    OUT,
    LSE,
    KP,
    KS,
    kp_slot,
    kp_head,
    ks_slot,
    ks_head,
    KI0,
    KN0,
    KC0,
    KG0,
    KR0,
    KI1,
    KN1,
    KC1,
    KG1,
    KR1,
    VP,
    VS,
    vp_slot,
    vp_head,
    vs_slot,
    vs_head,
    VI0,
    VN0,
    VC0,
    VI1,
    VN1,
    VC1,
    KT: tl.constexpr,
    VT: tl.constexpr,
    DP: tl.constexpr,
    HALF: tl.constexpr,
    HP: tl.constexpr,
    K_NP: tl.constexpr,
    K_D0: tl.constexpr,
    K_D1: tl.constexpr,
    K_B0: tl.constexpr,
    K_B1: tl.constexpr,
    K_P0: tl.constexpr,
    K_P1: tl.constexpr,
    K_PROD: tl.constexpr,
    K_ROPE: tl.constexpr,
    V_NP: tl.constexpr,
    V_D0: tl.constexpr,
    V_D1: tl.constexpr,
    V_B0: tl.constexpr,
    V_B1: tl.constexpr,
    V_P0: tl.constexpr,
    V_P1: tl.constexpr,
    BLOCK_M: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Stage 1: program (tile, KV head, split) → OUT (T, Hq, SPLITS, D) normalized partial outputs (TurboQuant values:
    the parts' rotated sums side by side) and LSE (T, Hq, SPLITS) their log2-sum-exp2 (−inf: an empty slice)."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    R: tl.constexpr = BLOCK_M * G_PAD
    BIG: tl.constexpr = 2147483647

    tok_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid_m = tok_m < T
    rows_m = tl.load(ROWS + tok_m, mask=valid_m, other=-1)
    r = tl.arange(0, R)
    tok_r = pid_m * BLOCK_M + r // G_PAD
    g = r % G_PAD
    valid_r = (tok_r < T) & (g < G)
    rows_r = tl.load(ROWS + tok_r, mask=tok_r < T, other=-1)
    pos_r = tl.load(POS + tok_r, mask=tok_r < T, other=0)
    lo_r = tl.where(window > 0, tl.maximum(pos_r + 1 - window, 0), 0)  # first key of each token's window
    qrow = tok_r.to(tl.int64) * Hq + head * G + g  # (R,) query row in (T·Hq)

    # the query (prepared: rotated per TurboQuant part for TurboQuant keys), loaded once
    cols = tl.arange(0, DP)
    if KT == TURBOQUANT:
        c0 = tl.arange(0, K_P0)
        q0 = tl.load(Q + qrow[:, None] * D + c0[None, :], mask=valid_r[:, None] & (c0 < K_D0)[None, :], other=0.0)
        qx0 = q0
        if K_PROD:
            qx0 = tl.load(QX + qrow[:, None] * D + c0[None, :], mask=valid_r[:, None] & (c0 < K_D0)[None, :], other=0.0)
        c1 = tl.arange(0, K_P1)
        m1 = valid_r[:, None] & (c1 < K_D1)[None, :]
        q1 = tl.load(Q + qrow[:, None] * D + K_D0 + c1[None, :], mask=m1, other=0.0)
        qx1 = q1
        if K_PROD:
            qx1 = tl.load(QX + qrow[:, None] * D + K_D0 + c1[None, :], mask=m1, other=0.0)
        if K_ROPE:
            hc = tl.arange(0, HP)
            mh = valid_r[:, None] & (hc < HALF)[None, :]
            ra = tl.load(RA + qrow[:, None] * HALF + hc[None, :], mask=mh, other=0.0)
            rb = tl.load(RB + qrow[:, None] * HALF + hc[None, :], mask=mh, other=0.0)
            invf = tl.load(INVF + hc, mask=hc < HALF, other=0.0)
    else:
        q = tl.load(Q + qrow[:, None] * D + cols[None, :], mask=valid_r[:, None] & (cols < D)[None, :], other=0.0)

    # tokens of the tile that share a block-table row are one run: count the distinct rows
    same = (rows_m[:, None] == rows_m[None, :]) & (tl.arange(0, BLOCK_M)[None, :] < tl.arange(0, BLOCK_M)[:, None])
    first = valid_m & (tl.sum(same.to(tl.int32), axis=1) == 0)
    n_runs = tl.sum(first.to(tl.int32), axis=0)
    done_m = ~valid_m
    for _ in range(n_runs):
        row = tl.min(tl.where(done_m, BIG, rows_m), axis=0)
        done_m = done_m | (rows_m == row)
        sel = valid_r & (rows_r == row)
        run_lo = tl.min(tl.where(sel, lo_r, BIG), axis=0)
        run_hi = tl.max(tl.where(sel, pos_r + 1, 0), axis=0)
        per = ((run_hi - run_lo + SPLITS - 1) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        s_lo = run_lo + split * per
        s_hi = tl.minimum(s_lo + per, run_hi)

        m_i = tl.full((R,), -1.0e30, tl.float32)
        l_i = tl.full((R,), 0.0, tl.float32)
        if VT == TURBOQUANT:
            acc0 = tl.full((R, V_P0), 0.0, tl.float32)
            acc1 = tl.full((R, V_P1), 0.0, tl.float32)
        else:
            acc0 = tl.full((R, DP), 0.0, tl.float32)
            acc1 = tl.full((R, 16), 0.0, tl.float32)
        for start in range(s_lo, s_hi, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            n_mask = kpos < s_hi
            page = tl.load(BT + row.to(tl.int64) * bt_stride + kpos // block_size, mask=n_mask, other=-1)
            n_mask = n_mask & (page >= 0)  # no page (a padded batch's −1 entry): no read
            slots = tl.maximum(page.to(tl.int64), 0) * block_size + kpos % block_size
            # scores (R, N)
            if KT == TURBOQUANT:
                s = _tq_part_scores(
                    q0, qx0, KI0, KN0, KC0, KG0, KR0, slots, head, hkv, n_mask, K_D0, K_B0, K_P0, K_PROD, DOT_PREC
                )
                if K_NP == 2:
                    s += _tq_part_scores(
                        q1, qx1, KI1, KN1, KC1, KG1, KR1, slots, head, hkv, n_mask, K_D1, K_B1, K_P1, K_PROD, DOT_PREC
                    )
                if K_ROPE:
                    theta = kpos.to(tl.float32)[:, None] * invf[None, :]
                    s += tl.dot(ra, tl.trans(tl.cos(theta)), input_precision=DOT_PREC)
                    s += tl.dot(rb, tl.trans(tl.sin(theta)), input_precision=DOT_PREC)
            else:
                k = _page_rows(KT, KP, KS, slots, head, kp_slot, kp_head, ks_slot, ks_head, n_mask, D, DP)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
            ok = sel[:, None] & n_mask[None, :] & (kpos[None, :] <= pos_r[:, None]) & (kpos[None, :] >= lo_r[:, None])
            s = tl.where(ok, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
            # values
            if VT == TURBOQUANT:
                acc0 = acc0 * alpha[:, None] + _tq_part_values(
                    p, VI0, VN0, VC0, slots, head, hkv, n_mask, V_D0, V_B0, V_P0, DOT_PREC
                )
                if V_NP == 2:
                    acc1 = acc1 * alpha[:, None] + _tq_part_values(
                        p, VI1, VN1, VC1, slots, head, hkv, n_mask, V_D1, V_B1, V_P1, DOT_PREC
                    )
            else:
                v = _page_rows(VT, VP, VS, slots, head, vp_slot, vp_head, vs_slot, vs_head, n_mask, D, DP)
                acc0 = acc0 * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)

        # this run's rows of the tile: partial output and its log2-sum-exp2
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        orow = (qrow * SPLITS + split) * D
        if VT == TURBOQUANT:
            o0 = tl.arange(0, V_P0)
            tl.store(
                OUT + orow[:, None] + o0[None, :], acc0 / l_safe[:, None], mask=sel[:, None] & (o0 < V_D0)[None, :]
            )
            if V_NP == 2:
                o1 = tl.arange(0, V_P1)
                tl.store(
                    OUT + orow[:, None] + V_D0 + o1[None, :],
                    acc1 / l_safe[:, None],
                    mask=sel[:, None] & (o1 < V_D1)[None, :],
                )
        else:
            tl.store(
                OUT + orow[:, None] + cols[None, :], acc0 / l_safe[:, None], mask=sel[:, None] & (cols < D)[None, :]
            )
        tl.store(LSE + qrow * SPLITS + split, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=sel)


@triton.jit
def _merge_kernel(PART, LSE, OUT, D, SPLITS: tl.constexpr, SP: tl.constexpr, DP: tl.constexpr):
    """Stage 2: program (query row of T·Hq) → OUT (T·Hq, D): the slices' outputs weighted by their softmax mass."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SP)
    cols = tl.arange(0, DP)
    lse = tl.load(LSE + row * SPLITS + sp, mask=sp < SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(top > float("-inf"), top, 0.0))  # all slices empty (no page): weights 0
    part = tl.load(
        PART + (row * SPLITS + sp[:, None]) * D + cols[None, :],
        mask=(sp < SPLITS)[:, None] & (cols < D)[None, :] & (lse > float("-inf"))[:, None],
        other=0.0,
    )
    total = tl.sum(w, axis=0)
    tl.store(OUT + row * D + cols, tl.sum(part * w[:, None], axis=0) / tl.where(total > 0, total, 1.0), mask=cols < D)
