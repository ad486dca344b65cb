"""KIVI KV cache (Liu et al., arXiv 2402.02750): spec ``kivi<bits>[g<group>]``, bits ∈ {2, 4}, group 32 by default.

Keys are quantized **per channel** (asymmetric, fp16 scale and zero point per channel) over groups of G
consecutive tokens; values **per token** (asymmetric, groups of 32 channels). A key group can only be
quantized once all G of its tokens exist, so the most recent tokens stay in full precision until their group
fills (the paper's residual, here at most G − 1 tokens per sequence).

Paged layout (this engine's design): groups are aligned to pages — G must divide the block size, so a group
never spans two physical blocks. Per slot: packed key and value codes; per key group: scale, zero (fp16, H×D)
and two int32 bookkeeping words (tokens written, staging page). Open groups live in a **staging pool** of
fp16 pages (G × H × D each), one page per ``STAGE_PERIOD`` pooled tokens — i.e. the pool supports one open
group (one running sequence) per 512 tokens of cache. The engine reads that limit (``max_sequences``) and runs
no more sequences at once (the others wait); a direct write beyond it raises a clear error. The pool is counted
in ``bytes_per_token`` (amortised), so the engine's block count accounts for it.

A write that touches a group's first slot starts that group afresh (a block reused by a new sequence or a
recomputation). The engine's ``free_sequence(seq_id)`` (a request finished or was preempted) releases the
sequence's open group at once — its staging page would otherwise stay taken until the block is reused;
the open group of each sequence is noted from the attention metadata of every step.

Attention: the native kernel reads these pages in place (``native_pages``: code pages ``kivi<bits>-keys`` and
``int<bits>-token-g32-asym``, ``kernels/cpu/csrc/kv_pages.h``) for decodes and prefill chunks alike — each key row
widened from its packed codes with its group's scale and zero, or taken from the staging page while its group is
open (the slot's group indexes ``stage_of``: one indirection per row, no separate call), each value row from its
per-token groups of 32 channels; the same numbers as :meth:`KiviKeyPages.decode`. The one-call decode step does
not write these pages (it says so in one line and the module path runs, its attention still native).
"""

from __future__ import annotations

import re

import torch

from ..errors import BytedietError, ConfigError
from ..kernels.decoder_spec import CodePageSide
from . import bitpack
from .base import KV_CODECS
from .compressed import CompressedCodec
from .halves import HalfCodec, HalfPages
from .tokenwise import TokenwiseHalf

STAGE_PERIOD = 512


def quantize_groups(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (n, G, H, D) → codes (n, G, H, D) int64, scale and zero (n, H, D) fp16, per channel over tokens."""
    zero = x.amin(1).to(torch.float16)
    scale = ((x.amax(1) - zero.float()) / (2**bits - 1)).clamp(min=1e-6).to(torch.float16)
    codes = torch.round((x - zero.float()[:, None]) / scale.float()[:, None]).clamp(0, 2**bits - 1)
    return codes.long(), scale, zero


class KiviKeyPages(HalfPages):
    def __init__(self, num_slots, num_heads, head_dim, device, bits: int, group: int) -> None:
        super().__init__(num_slots, num_heads, head_dim, device)
        self.bits, self.group = bits, group
        n_groups = num_slots // group
        self.codes = torch.zeros(
            num_slots, num_heads, bitpack.packed_size(head_dim, bits), dtype=torch.uint8, device=device
        )
        self.scale = torch.zeros(n_groups, num_heads, head_dim, dtype=torch.float16, device=device)
        self.zero = torch.zeros_like(self.scale)
        self.fill = torch.zeros(n_groups, dtype=torch.int32, device=device)
        self.stage_of = torch.full((n_groups,), -1, dtype=torch.int32, device=device)
        n_stage = max(1, num_slots // STAGE_PERIOD)
        self.stage = torch.zeros(n_stage, group, num_heads, head_dim, dtype=torch.float16, device=device)
        self.free_pages = list(range(n_stage))
        self.open_group: dict[int, int] = {}  # engine seq id → its open (staged) group

    def track_sequences(self, meta) -> None:
        """Note each sequence's last group (the one a later write extends); called once per attend."""
        if meta.seq_ids is None:
            return
        for s, (sid, ctx) in enumerate(zip(meta.seq_ids, meta.context_lens_list)):
            slot = (
                int(meta.block_tables[s, (ctx - 1) // meta.block_size]) * meta.block_size + (ctx - 1) % meta.block_size
            )
            g = slot // self.group
            if int(self.stage_of[g]) >= 0:
                self.open_group[sid] = g
            else:
                self.open_group.pop(sid, None)

    def max_sequences(self) -> int:
        """One open group per running sequence, one staging page per open group."""
        return self.stage.shape[0]

    def free_sequence(self, seq_id: int) -> None:
        g = self.open_group.pop(seq_id, None)
        if g is not None:
            self._release(g)
            self.fill[g] = 0

    def _release(self, g: int) -> None:
        page = int(self.stage_of[g])
        if page >= 0:
            self.free_pages.append(page)
            self.stage_of[g] = -1

    def _store_group(self, g: int, xg: torch.Tensor) -> None:
        """Quantize one complete group xg (G, H, D) into its slots."""
        codes, scale, zero = quantize_groups(xg[None].float(), self.bits)
        self.codes[g * self.group : (g + 1) * self.group] = bitpack.pack(codes[0], self.bits)
        self.scale[g], self.zero[g] = scale[0], zero[0]

    def write(self, x, slots):
        groups, offs = slots // self.group, slots % self.group
        for g in torch.unique(groups).tolist():
            sel = groups == g
            xs, os = x[sel], offs[sel]
            if bool((os == 0).any()):  # the group starts afresh
                self._release(g)
                self.fill[g] = 0
            self.fill[g] += len(os)
            full = int(self.fill[g]) >= self.group
            if full and int(self.stage_of[g]) < 0:  # whole group in this write: no staging
                self._store_group(g, xs[torch.argsort(os)])
                continue
            if int(self.stage_of[g]) < 0:
                if not self.free_pages:
                    raise BytedietError(
                        f"kivi: more than {self.stage.shape[0]} KV groups are open at once (one per running "
                        f"sequence, one staging page per {STAGE_PERIOD} cache tokens); give the KV cache more "
                        "memory or run fewer sequences at once"
                    )
                self.stage_of[g] = self.free_pages.pop()
            page = int(self.stage_of[g])
            self.stage[page, os] = xs.to(torch.float16)
            if full:
                self._store_group(g, self.stage[page].float())
                self._release(g)

    def decode(self, slots):
        n = slots.shape[0]
        g = slots // self.group
        q = bitpack.unpack(self.codes[slots], self.bits, self.head_dim).float()
        x = q * self.scale[g].float() + self.zero[g].float()
        page = self.stage_of[g].long()
        open_ = page >= 0
        if bool(open_.any()):
            x[open_] = self.stage[page[open_], slots[open_] % self.group].float()
        return x.reshape(n, self.num_heads, self.head_dim)

    def native_pages(self):
        """The codes, read by the native attention with each group's scale and zero, open groups from their staging
        page (``decoder_spec.CodePageSide``); the same numbers as :meth:`decode`."""
        if self.head_dim % 8:
            return None
        return (
            f"kivi{self.bits}-keys",
            self.codes,
            None,
            CodePageSide(self.scale, self.zero, self.stage_of, self.stage, self.group),
        )

    def tensors(self):
        return [self.codes, self.scale, self.zero, self.fill, self.stage_of, self.stage]


class KiviKeyHalf(HalfCodec):
    def __init__(self, bits: int, group: int) -> None:
        self.bits, self.group = bits, group
        self.name = f"kivi{bits}-keys-g{group}"

    def min_block_size(self):
        return self.group

    def check(self, num_heads, head_dim, block_size):
        if block_size % self.group:
            raise ConfigError(
                f"kivi group size {self.group} must divide the KV block size {block_size}; "
                f"use a block size of at least {self.group} or a spec like kivi{self.bits}g{block_size}"
            )

    def bytes_per_token(self, num_heads, head_dim):
        codes = head_dim * self.bits / 8
        group_side = (2 * 2 * head_dim) / self.group  # fp16 scale + zero per channel per group
        stage = self.group * head_dim * 2 / STAGE_PERIOD  # fp16 staging, amortised
        return num_heads * (codes + group_side + stage) + 2 * 4 / self.group  # + fill, stage_of (int32)

    def create(self, layer, role, num_blocks, block_size, num_heads, head_dim, device):
        return KiviKeyPages(num_blocks * block_size, num_heads, head_dim, device, self.bits, self.group)


_SPEC = re.compile(r"^([24])(?:g(\d+))?$")


@KV_CODECS.register("kivi")
class KiviCodec(CompressedCodec):
    def __init__(self, bits: int = 2, group: int = 32) -> None:
        if bits not in (2, 4):
            raise ConfigError(f"kivi supports 2 or 4 bits, got {bits}")
        if group < 1 or group & (group - 1):
            raise ConfigError(f"kivi group size must be a power of two, got {group}")
        super().__init__(
            f"kivi{bits}" + ("" if group == 32 else f"g{group}"),
            KiviKeyHalf(bits, group),
            TokenwiseHalf(bits, group=32, symmetric=False),
        )

    @classmethod
    def from_spec(cls, rest: str) -> "KiviCodec":
        if not rest:
            return cls()
        m = _SPEC.match(rest)
        if not m:
            raise ConfigError(
                f"bad KIVI spec 'kivi{rest}': expected kivi2, kivi4 or kivi<bits>g<group> (e.g. kivi2g16)"
            )
        return cls(int(m.group(1)), int(m.group(2) or 32))
