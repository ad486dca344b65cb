"""The codecs an ``auto:<bits>`` plan (:mod:`bytediet.calibrate.kv_budget`) chooses from, per layer and half.

Candidates page 16-token blocks: bf16, llama.cpp's block types (8.5 … 4.5 bits), bytediet's int8 (one
scale per token and head: 8 + 16/D bits, the one below q8_0's 8.5 — it lets a plan at 8.5 bits buy bf16 for the
layers that need it), the rotated 8-bit codecs ``rot-q8_0`` and ``rot-int8`` (the same pages after a randomized
Hadamard rotation, which spreads outlier key channels: lower error at the same bytes in most layers, not all —
:mod:`bytediet.kvcache.rotated`) and TurboQuant (4 … 2 bits). A candidate that cannot take the model's head
dimension is skipped; a budget below the cheapest candidate is an error naming the budget.

A candidate ``k=<spec>`` (``v=<spec>``) offers only that codec's key (value) half: ``k=kivi4g16`` / ``k=kivi2g16``
(:data:`CHANNEL_KEY_CANDIDATES`, opt-in) are
KIVI's per-channel keys (fp16 scale and zero point per channel over 16-token groups, the open group staged in fp16,
:mod:`bytediet.kvcache.kivi`; 6.53 / 4.53 bits all-in at 2 KV heads × 64), which take out the per-channel offset of
bias-dominated keys (Qwen2.5, bench/KV_RESULTS.md §15) and mix with any value half; group 16 so that they page the
plans' 16-token blocks. On the Triton path halves stored as code pages, these among them, are left out
(:func:`without_code_pages`).
"""

from __future__ import annotations

from typing import Sequence

from ..errors import ConfigError
from ..kvcache.split import half_of

DEFAULT_CANDIDATES = (
    "bf16",
    "q8_0",
    "rot-q8_0",
    "int8",
    "rot-int8",
    "q5_0",
    "q4_1",
    "q4_0",
    "turboquant4",
    "turboquant3.5",
    "turboquant3",
    "turboquant2.5",
    "turboquant2",
)
# KIVI's per-channel keys, offered with ``--kv-pareto-candidates`` (not by default: a plan with them decodes on the
# module path, the native one-call decode step writes no such pages; bench/KV_RESULTS.md §16)
CHANNEL_KEY_CANDIDATES = ("k=kivi4g16", "k=kivi2g16")


def candidate_roles(candidates: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """spec → the halves it is a candidate for: ``k=<spec>`` / ``v=<spec>`` that codec's key / value half only, any
    other entry (``q8_0``, a split ``k=q8_0,v=q4_0``) both."""
    out: dict[str, tuple[str, ...]] = {}
    for entry in candidates:
        role, sep, spec = entry.partition("=")
        only = bool(sep) and "," not in spec and role.strip() in ("k", "v")
        spec = spec.strip() if only else entry
        if only and not spec:
            raise ConfigError(f"bad KV budget candidate {entry!r}: expected k=<codec> or v=<codec>, e.g. k=kivi4g16")
        roles = {role.strip()} if only else {"k", "v"}
        out[spec] = tuple(r for r in ("k", "v") if r in roles or r in out.get(spec, ()))
    return out


def without_code_pages(codecs: dict, roles: dict, num_kv_heads: int, head_dim: int) -> dict:
    """``roles`` less the halves stored as code pages (KIVI's per-channel keys): the Triton paged attention reads none
    (:func:`bytediet.kernels.triton.paged_attention.check_pages`), so a plan for the GPU never takes them."""
    from ..kernels.decoder_spec import CODE_PAGE_TYPES

    def code_pages(spec: str, role: str) -> bool:
        try:
            pages = half_of(codecs[spec], role).create(0, role, 1, 16, num_kv_heads, head_dim, "cpu").native_pages()
        except ConfigError:
            return False  # a shape it cannot store: left out by the measurement anyway
        return pages is not None and pages[0] in CODE_PAGE_TYPES

    return {s: tuple(r for r in rs if not code_pages(s, r)) for s, rs in roles.items()}
