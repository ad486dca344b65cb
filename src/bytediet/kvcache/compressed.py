"""A KV cache made of a key half and a value half, read with a blockwise online softmax.

``attend`` never materialises a sequence's whole context in full precision: it walks the sequence's
block table a chunk of blocks at a time (``CHUNK_TOKENS``), asks the key half for scores of that chunk
(directly on codes where the half supports it), and folds the chunk into a running softmax
(Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; FlashAttention, arXiv 2205.14135):

    m' = max(m, max_j s_j);  l' = l·e^(m−m') + Σ_j e^(s_j−m');  acc' = acc·e^(m−m') + Σ_j e^(s_j−m') v_j

Blocks wholly before a sliding window are skipped. Compute is float32; the output is cast to q's dtype.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from ..errors import ConfigError
from ..kernels import backend
from ..kernels.decoder_spec import ATTENTION_PAGE_TYPES
from ..kernels.reference import sequence_slots
from .base import AttentionMetadata, KVCodec, LayerKVCache, StepPages
from .halves import HalfCodec, HalfPages

CHUNK_TOKENS = 512


class CompressedCache(LayerKVCache):
    def __init__(self, keys: HalfPages, values: HalfPages, num_blocks: int, block_size: int) -> None:
        self.keys, self.values = keys, values
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = keys.num_heads, keys.head_dim

    def write(
        self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, positions: Optional[torch.Tensor] = None
    ) -> None:
        for half, x in ((self.keys, k), (self.values, v)):
            if half.uses_positions:
                if positions is None:
                    raise ValueError(f"{type(half).__name__} stores position-dependent codes: pass positions")
                half.write(x.float(), slot_mapping, positions)
            else:
                half.write(x.float(), slot_mapping)

    def free_sequence(self, seq_id: int) -> None:
        for half in (self.keys, self.values):
            if hasattr(half, "free_sequence"):
                half.free_sequence(seq_id)

    def max_sequences(self) -> Optional[int]:
        limits = [n for n in (self.keys.max_sequences(), self.values.max_sequences()) if n is not None]
        return min(limits) if limits else None

    def tensors(self) -> list[torch.Tensor]:
        return self.keys.tensors() + self.values.tensors()

    def decode(
        self, slots: torch.Tensor, positions: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(L,) slots of one sequence → float32 (k, v), each (L, H, D): the reference read used by the tests.

        ``positions`` (L,) default to 0 … L − 1 (the slots of one sequence, in order)."""
        if positions is None:
            positions = torch.arange(slots.shape[0], device=slots.device)
        return tuple(
            h.decode(slots, positions) if h.uses_positions else h.decode(slots) for h in (self.keys, self.values)
        )

    def native_pages(self) -> Optional[dict]:
        """Both halves' pages when the native attention reads each in place, whatever their types (k=q8_0,v=q4_0);
        code pages (KIVI, QJL, PolarQuant, HF's) with their side data (``k_side``/``v_side``); TurboQuant pages (their
        spec as the side data) on both sides or beside row or block pages (an ``auto:<bits>`` plan's
        k=q5_0,v=turboquant4). None when a half is stored rotated (pages in another basis):
        :meth:`attention_pages` gives them, and the readers that know the halves' ``rotation`` (this cache's
        :meth:`attend_natively`, the native decode step) rotate around them."""
        if self.keys.rotation is not None or self.values.rotation is not None:
            return None
        return self.attention_pages()

    def attention_pages(self) -> Optional[dict]:
        """:meth:`native_pages` whatever basis the halves are stored in."""
        k, v = self.keys.native_pages(), self.values.native_pages()
        if k is None or v is None:
            return None
        (kt, kc, ks, kside), (vt, vc, vs, vside) = ((*h, None)[:4] for h in (k, v))
        if (kt == "turboquant") != (vt == "turboquant") and not {kt, vt} <= {"turboquant", *ATTENTION_PAGE_TYPES}:
            return None  # TurboQuant pages beside row or block pages only (k=q5_0,v=turboquant4), not code pages
        return dict(k_dtype=kt, v_dtype=vt, k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs, k_side=kside, v_side=vside)

    def step_ready(self) -> bool:
        return self.keys.step_ready() and self.values.step_ready()

    def step_pages(self) -> StepPages:
        """Each half's pages as the native decode step reads and writes them (``HalfPages.step_side``: row, block or
        TurboQuant pages, in any k/v mix) with the halves' rotations, or the first half's objection."""
        sides = [h.step_side() for h in (self.keys, self.values)]
        objection = next((why for side, why in sides if side is None), None)
        if objection is not None:
            return StepPages(
                objection=f"KV cache of {type(self.keys).__name__} keys, {type(self.values).__name__} "
                f"values has no native step: {objection}"
            )
        (kt, kc, ks, ktq), (vt, vc, vs, vtq) = (side for side, _ in sides)
        rotation = lambda h: None if h.rotation is None else h.rotation.float().contiguous()
        return StepPages(
            dict(
                k_dtype=kt,
                v_dtype=None if vt == kt == "turboquant" else vt,
                k_cache=kc,
                v_cache=vc,
                k_scale=ks,
                v_scale=vs,
                k_tq=ktq,
                v_tq=vtq,
                k_rot=rotation(self.keys),
                v_rot=rotation(self.values),
            )
        )

    def attend_natively(
        self, q: torch.Tensor, meta: AttentionMetadata, scale: float, window: Optional[int]
    ) -> Optional[torch.Tensor]:
        """The native attention over the pages in place; rotated halves (R: pages hold x Rᵀ) by q·k = (q Rᵀ)·(k Rᵀ)
        and Σ p v = (Σ p v Rᵀ) R — the query rotated before the kernel, the output after."""
        rk, rv = self.keys.rotation, self.values.rotation
        if rk is not None and (q.dtype == torch.float32 or backend.triton_selected(q)):
            q = (q.float() @ rk.T).to(q.dtype)
        out = super().attend_natively(q, meta, scale, window)
        return out if out is None or rv is None else (out.float() @ rv).to(out.dtype)

    def attend(
        self, q: torch.Tensor, meta: AttentionMetadata, scale: float, window: Optional[int] = None
    ) -> torch.Tensor:
        for half in (self.keys, self.values):
            if hasattr(half, "track_sequences"):  # halves with per-sequence state (KIVI's open groups)
                half.track_sequences(meta)
        out = self.attend_natively(q, meta, scale, window)
        if out is not None:
            return out
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        for s, (n, ctx) in enumerate(zip(meta.query_lens_list, meta.context_lens_list)):
            if n:
                lo = starts[s]
                out[lo : lo + n] = self._attend_sequence(
                    q[lo : lo + n].float(), meta.block_tables[s], ctx, scale, window
                ).to(q.dtype)
        return out

    def _attend_sequence(
        self, q: torch.Tensor, block_table: torch.Tensor, ctx: int, scale: float, window: Optional[int]
    ) -> torch.Tensor:
        """q: (n, Hq, D) for positions ctx−n … ctx−1 → (n, Hq, D) float32."""
        n, hq, d = q.shape
        hkv = self.num_kv_heads
        group = hq // hkv
        qg = q.reshape(n, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * n, d)  # rows: (group, n)
        qpos = torch.arange(ctx - n, ctx, device=q.device).repeat(group)  # (G,)
        prepared = self.keys.prepare_query(qg)
        m = torch.full((hkv, group * n, 1), float("-inf"), device=q.device)
        denom = torch.zeros(hkv, group * n, 1, device=q.device)  # l in the recurrence above
        acc = None
        first = 0 if window is None else max(0, ctx - n - window + 1)
        slots_all = sequence_slots(block_table, ctx, self.block_size)
        step = max(self.block_size, CHUNK_TOKENS // self.block_size * self.block_size)
        for lo in range(first // self.block_size * self.block_size, ctx, step):
            hi = min(ctx, lo + step)
            slots = slots_all[lo:hi]
            kpos = torch.arange(lo, hi, device=q.device)
            allowed = kpos[None, :] <= qpos[:, None]
            if window is not None:
                allowed &= kpos[None, :] > qpos[:, None] - window
            s = (
                self.keys.scores(prepared, slots, kpos)
                if self.keys.uses_positions
                else self.keys.scores(prepared, slots)
            ) * scale  # (H, G, L)
            s = s.masked_fill(~allowed, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe)
            corr = torch.exp(m - m_safe)
            denom = denom * corr + p.sum(-1, keepdim=True)
            part = self.values.weighted_sum(p, slots)
            acc = part if acc is None else acc * corr + part
            m = m_new
        o = self.values.finish(acc / denom)  # (H, G, D)
        return o.reshape(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)


class CompressedCodec(KVCodec):
    """A KV codec assembled from a key half and a value half (each codec file builds one of these)."""

    def __init__(self, name: str, key_half: HalfCodec, value_half: HalfCodec) -> None:
        self.name, self.key_half, self.value_half = name, key_half, value_half

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float:
        return self.key_half.bytes_per_token(num_kv_heads, head_dim) + self.value_half.bytes_per_token(
            num_kv_heads, head_dim
        )

    def min_block_size(self) -> int:
        return max(self.key_half.min_block_size(), self.value_half.min_block_size())

    def create_cache(self, layer, num_blocks, block_size, num_kv_heads, head_dim, dtype, device) -> LayerKVCache:
        for half in (self.key_half, self.value_half):
            half.check(num_kv_heads, head_dim, block_size)
        keys = self.key_half.create(layer, "k", num_blocks, block_size, num_kv_heads, head_dim, device)
        values = self.value_half.create(layer, "v", num_blocks, block_size, num_kv_heads, head_dim, device)
        return CompressedCache(keys, values, num_blocks, block_size)

    def calibration_state(self) -> Optional[dict]:
        """{"k": the key half's state, "v": the value half's}, or None when neither half was calibrated."""
        k, v = self.key_half.calibration_state(), self.value_half.calibration_state()
        return None if k is None and v is None else {"k": k, "v": v}

    def load_calibration_state(self, state: dict, rope=None) -> None:
        unknown = set(state) - {"k", "v"}
        if unknown:
            raise ConfigError(
                f"KV codec {self.name!r}: calibration state has unknown parts {sorted(unknown)} (expected 'k' and 'v')"
            )
        for half, role in ((self.key_half, "k"), (self.value_half, "v")):
            if state.get(role) is not None:
                half.load_calibration_state(state[role], rope=rope)

    def describe(self, head_dim: Optional[int] = None) -> str:
        return f"{self.name} (k: {self.key_half.describe(head_dim)}, v: {self.value_half.describe(head_dim)})"

    def for_heads(self, lo: int, hi: int) -> "CompressedCodec":
        key, value = self.key_half.for_heads(lo, hi), self.value_half.for_heads(lo, hi)
        if key is self.key_half and value is self.value_half:
            return self
        out = copy.copy(self)
        out.key_half, out.value_half = key, value
        return out
