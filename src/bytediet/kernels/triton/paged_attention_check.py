"""The Triton paged attention against its twin on realistic shapes (for the device check on a GPU): random pages of
every mix, the twin on the CPU, the kernel on ``device``; its error and, on CUDA, its time and KV read bandwidth."""

from __future__ import annotations

import math
import time
from typing import Optional

import torch

from .. import reference
from ..decoder_spec import TurboQuantPageSpec, TurboQuantPart
from .paged_attention import attention_over_pages

BLOCK = 16  # tokens a page
MIXES = [
    ("bf16", "bf16"),
    ("fp16", "fp16"),
    ("int8", "int8"),
    ("fp8", "fp8"),
    ("q8_0", "q8_0"),
    ("q8_0", "q4_0"),
    ("q5_0", "q4_1"),
    ("int8", "q4_0"),
    ("turboquant", "turboquant"),
    ("q5_0", "turboquant"),
]


def check_shapes() -> list[dict]:
    """Realistic shapes: Llama-3-8B (32/8 heads of 128), a 1B model (32/8 of 64), Gemma-3 (8/4 of 256, window 1024),
    Qwen2 (28/4 of 128); decode batches over long ragged contexts, a prefill chunk after a prefix-cache hit beside a
    decode, a whole prompt. seqs: (new tokens, context) per sequence; mixes: (key, value) page types."""
    return [
        {
            "name": "llama3-8b-decode-b16",
            "hq": 32,
            "hkv": 8,
            "d": 128,
            "window": None,
            "seqs": [(1, c) for c in (4096, 1, 777, 2048, 3000, 17, 4095, 1500) * 2],
            "mixes": MIXES,
        },
        {
            "name": "1b-decode-b64",
            "hq": 32,
            "hkv": 8,
            "d": 64,
            "window": None,
            "seqs": [(1, 64 + 61 * i) for i in range(64)],
            "mixes": MIXES,
        },
        {
            "name": "gemma3-window-decode",
            "hq": 8,
            "hkv": 4,
            "d": 256,
            "window": 1024,
            "seqs": [(1, c) for c in (3000, 500, 1025)],
            "mixes": MIXES,
        },
        {
            "name": "llama3-8b-prefill-after-hit",
            "hq": 32,
            "hkv": 8,
            "d": 128,
            "window": None,
            "seqs": [(256, 1280), (1, 900)],
            "mixes": MIXES,
        },
        {
            "name": "qwen2-prefill",
            "hq": 28,
            "hkv": 4,
            "d": 128,
            "window": None,
            "seqs": [(256, 256)],
            "mixes": MIXES[:5],
        },
    ]


def ragged_batch(seqs, gen, spare: int = 0, dtype=torch.int32):
    """Block tables (``dtype``) over shuffled pages (``spare`` unused; unused entries −1), each token's position and
    table row, and the slot count, for sequences given as (new tokens, context) pairs (the tests' batches too)."""
    width = max(-(-ctx // BLOCK) for _, ctx in seqs)
    perm = torch.randperm(sum(-(-ctx // BLOCK) for _, ctx in seqs) + spare, generator=gen)
    tables, positions, rows, used = [], [], [], 0
    for s, (n, ctx) in enumerate(seqs):
        nb = -(-ctx // BLOCK)
        tables.append(torch.cat([perm[used : used + nb], torch.full((width - nb,), -1)]))
        used += nb
        positions += list(range(ctx - n, ctx))
        rows += [s] * n
    return torch.stack(tables).to(dtype), torch.tensor(positions), torch.tensor(rows), perm.numel() * BLOCK


def _turboquant(gen, slots, hkv, d, keys: bool) -> TurboQuantPageSpec:
    """Random TurboQuant pages: keys of the inner-product variant at 4 + 2 MSE bits (16 + d−16 channels) with a
    pre-RoPE mean, values MSE at 3 bits with a constant mean; a channel order; Haar rotations, sorted codebooks."""
    layout = [(16, 4), (d - 16, 2)] if keys else [(d, 3)]
    parts = []
    for n, b in layout:
        rot = torch.linalg.qr(torch.randn(n, n, generator=gen))[0]
        book = torch.sort(torch.randn(2**b, generator=gen) / math.sqrt(n)).values
        parts.append(
            TurboQuantPart(
                n,
                b,
                rot,
                book,
                (torch.rand(slots, hkv, generator=gen) * 3 + 0.1).half(),
                torch.randint(0, 256, (slots, hkv, n * b // 8), generator=gen, dtype=torch.uint8),
                torch.randint(0, 256, (slots, hkv, n // 8), generator=gen, dtype=torch.uint8) if keys else None,
                (torch.rand(slots, hkv, generator=gen) * 0.6).half() if keys else None,
                torch.randn(n, n, generator=gen) if keys else None,
            )
        )
    channels = torch.stack([torch.randperm(d, generator=gen) for _ in range(hkv)])
    mu = torch.randn(hkv, d, generator=gen)
    if keys:
        return TurboQuantPageSpec(parts, channels, None, mu, 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    return TurboQuantPageSpec(parts, channels, mu)


def _side(gen, dtype, slots, hkv, d, keys):
    if dtype == "turboquant":
        return {"cache": None, "scale": None, "side": _turboquant(gen, slots, hkv, d, keys)}
    pages, scales = reference.write_kv_rows(dtype, torch.randn(slots, hkv, d, generator=gen) * 2)
    return {"cache": pages, "scale": scales, "side": None}


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (TurboQuantPageSpec, TurboQuantPart)):
        return type(x)(**{k: _to(v, device) for k, v in vars(x).items()})
    if isinstance(x, list):
        return [_to(y, device) for y in x]
    return x


def _bytes(k, v, seqs, hkv) -> int:
    """KV bytes a call reads at least: every sequence's context once, keys and values."""

    def per_slot(side):
        tensors = (
            [side["cache"], side["scale"]]
            if side["side"] is None
            else [t for p in side["side"].parts for t in (p.idx, p.norm, p.signs, p.res_norm) if t is not None]
        )
        return sum(t[0].numel() * t.element_size() for t in tensors if t is not None)

    return sum(ctx for _, ctx in seqs) * (per_slot(k) + per_slot(v))


def check(device: str = "cuda", shapes: Optional[list[dict]] = None, seed: int = 0, reps: int = 20) -> list[dict]:
    """Every shape × mix of :func:`check_shapes` (or ``shapes``): the max error against the twin relative to
    max(1, max|out|) in float32 dots ("ieee", tolerance 1e-4) and in the default dots (tf32 on CUDA, 2e-2), and on
    CUDA the milliseconds a call and the KV bytes it reads per second. → one dict per case, ``ok`` both within."""
    results = []
    for shape in shapes or check_shapes():
        for k_dtype, v_dtype in shape["mixes"]:
            gen = torch.Generator().manual_seed(seed)
            hq, hkv, d = shape["hq"], shape["hkv"], shape["d"]
            bt, positions, rows, slots = ragged_batch(shape["seqs"], gen)
            k, v = _side(gen, k_dtype, slots, hkv, d, True), _side(gen, v_dtype, slots, hkv, d, False)
            q = torch.randn(len(positions), hq, d, generator=gen)
            args = [
                q,
                positions,
                rows,
                bt,
                BLOCK,
                d**-0.5,
                shape["window"],
                k_dtype,
                k["cache"],
                v["cache"],
                k["scale"],
                v["scale"],
                v_dtype,
            ]
            want = reference.attention_over_pages(*args, k_side=k["side"], v_side=v["side"])
            dev_args, sides = _to(args, device), {"k_side": _to(k["side"], device), "v_side": _to(v["side"], device)}
            norm = max(1.0, want.abs().max().item())
            err = {
                p: (attention_over_pages(*dev_args, **sides, precision=p).cpu() - want).abs().max().item() / norm
                for p in ("ieee", None)
            }
            row = {
                "shape": shape["name"],
                "k": k_dtype,
                "v": v_dtype,
                "tokens": len(positions),
                "err_fp32": err["ieee"],
                "err_default": err[None],
                "ok": err["ieee"] <= 1e-4 and err[None] <= 2e-2,
            }
            if str(device).startswith("cuda"):
                ms = _time(lambda a=dev_args, s=sides: attention_over_pages(*a, **s), reps)
                row.update(ms=ms, kv_gbps=_bytes(k, v, shape["seqs"], hkv) / ms / 1e6)
            results.append(row)
    return results


def _time(fn, reps: int) -> float:
    """Milliseconds a call of ``fn`` on CUDA, after a warm-up (compilation)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / reps


# (keys, values, decode, query heads per KV head, head_dim): the configurations compile_for builds by default
COMPILE_CASES = [
    ("q5_0", "turboquant", True, 4, 128),
    ("turboquant", "q4_0", False, 4, 128),
    ("bf16", "fp8", True, 2, 256),
    ("int8", "q8_0", False, 7, 64),
]
_PTR = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}


def compile_for(arch: int = 90, cases=COMPILE_CASES) -> list[dict]:
    """Compile the kernels ahead of time for CUDA sm_``arch`` (no GPU needed, triton's own ptxas; the interpreter
    off): catches what only the compiler sees. TurboQuant sides: 2 parts (16 + d−16 keys, inner-product with a
    pre-RoPE mean; 8 + d−8 values). → one dict per case: shared memory bytes of the compiled kernel."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..decoder_spec import KV_PAGE_TYPES
    from . import paged_attention_kernels as K
    from .paged_attention import tiling, triton_next_pow2

    target, out = GPUTarget("cuda", arch, 32), []
    names = list(inspect.signature(K._attn_kernel.fn).parameters)
    for kt, vt, decode, g, d in cases:
        dp, cfg = max(16, triton_next_pow2(d)), tiling(decode, g, d, "turboquant" in (kt, vt))
        const = {
            "KT": KV_PAGE_TYPES.index(kt),
            "VT": KV_PAGE_TYPES.index(vt),
            "DP": dp,
            "HALF": d // 2,
            "HP": max(16, triton_next_pow2(d // 2)),
            "SPLITS": 4 if decode else 1,
            "DOT_PREC": "tf32",
            **{k: v for k, v in cfg.items() if k != "num_warps"},
        }
        for side, dtype, split in (("K_", kt, (16, 4, 2)), ("V_", vt, (8, 4, 3))):
            n0, b0, b1 = split if dtype == "turboquant" else (16, 8, 8)
            const.update(
                {
                    side + "NP": 2 if dtype == "turboquant" else 1,
                    side + "D0": n0,
                    side + "D1": d - n0,
                    side + "B0": b0,
                    side + "B1": b1,
                    side + "P0": max(16, triton_next_pow2(n0)),
                    side + "P1": max(16, triton_next_pow2(d - n0)),
                }
            )
        const.update(K_PROD=kt == "turboquant", K_ROPE=kt == "turboquant")
        types = {
            "qk_scale": "fp32",
            "POS": "*i32",
            "ROWS": "*i32",
            "BT": "*i32",
            "KP": _PTR.get(kt, "*u8"),
            "VP": _PTR.get(vt, "*u8"),
            "KS": "*fp16",
            "VS": "*fp16",
        }
        types.update(
            {
                n: {"I": "*u8", "G": "*u8", "N": "*fp16", "R": "*fp16", "C": "*fp32"}[n[1]]
                for n in names
                if n[0] in "KV" and n[1] in "INRCG" and n[-1] in "01"
            }
        )
        ints = {"T", "Hq", "G", "D"}
        sig = {
            n: "constexpr" if n in const else types.get(n, "*fp32" if n.isupper() and n not in ints else "i32")
            for n in names
        }
        src = ASTSource(K._attn_kernel, sig, {(i,): const[n] for i, n in enumerate(names) if n in const})
        compiled = triton.compile(src, target=target, options={"num_warps": cfg["num_warps"]})
        out.append({"k": kt, "v": vt, "decode": decode, "g": g, "d": d, "shared": compiled.metadata.shared})
    return out
