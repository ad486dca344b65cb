"""TurboQuant KV cache (arXiv 2504.19874): specs ``turboquant<bits>[:qr]`` and ``turboquant_prod<bits>[:qr]``.

``<bits>`` is the **all-in** budget in bits per stored coordinate, fp16 norms included (at head dim 64 one
norm costs 0.25 bits). The layout is solved per head dim (:func:`resolve_layout`): the largest base width
b ∈ 1…4 whose single instance fits (uncalibrated default), then — the paper's *outlier split* (§4.3) — the largest
number of outlier channels (a multiple of 8) that can get b+1 bits in a second instance with its own norm, rotation
and codebook. E.g. at D = 128: ``turboquant2.5`` = 32 channels at 3 bits + 96 at 2 bits + 2 fp16 norms,
``turboquant3.5`` = 32 at 4 + 96 at 3; at D = 64, ``turboquant3.5`` = plain 3-bit (3.25 bits all-in).

Values always use the MSE variant. Keys use MSE (``turboquant``) or inner-product (``turboquant_prod``:
MSE at b−1 bits + 1-bit QJL residual, unbiased scores). ``:qr`` selects a Haar (QR) rotation instead of
the randomized Hadamard; a part whose size is not a power of two always uses QR (documented fallback).

**Calibration** (:mod:`bytediet.calibrate.kv`, from calibration text; see :class:`TurboQuantHalf`): per layer the
channel mean is subtracted before quantizing (exact for attention), the outlier channels are ranked by
expected score error, and one layout for all layers is chosen by predicted error among every two-part
split that fits the budget (:func:`choose_layout`; outlier parts up to 8 bits). **Fallback without
calibration:** no mean, the default layout, and outlier channels chosen from the tokens of the layer's
first write (the first prefill), then frozen. Per-layer constants (rotations, sketches, channel order,
means) are not pages.

Attention: the native kernel reads the codes in place (``native_pages``: a ``TurboQuantPageSpec`` per half,
``kernels/cpu/csrc/turboquant_pages.cpp``) for decodes and prefill chunks: the query rotated — for ``turboquant_prod``
keys also sketched — once per head, each key scored on its codes (centroids looked up in registers, the residual's
sign bits flipping the sketched query), values summed in rotated coordinates and rotated back once. The one-call
decode step writes and reads the MSE variant; it does not write ``turboquant_prod`` keys (it says so in one line; the
module path runs, its attention native).
"""

from __future__ import annotations

import re
import warnings
from typing import Optional

import torch

from ..errors import ConfigError
from ..kernels import ops
from ..kernels.decoder_spec import TurboQuantPageSpec, TurboQuantPart
from . import bitpack
from .base import KV_CODECS
from .compressed import CompressedCodec
from .halves import HalfCodec, HalfPages
from .rotation import rotation_kind
from .state import layer_map
from .turboquant_core import TQCodes, TurboQuantizer
from .turboquant_layout import choose_layout, layout_bits

MIN_BITS, MAX_BITS = 1.0, 5.0


class TurboQuantPages(HalfPages):
    """``mean`` (H, D): a constant subtracted before quantizing. ``rope_mean`` = (μ (H, D), the layer's
    :class:`~bytediet.models.layers.RotaryEmbedding`): instead a *pre-RoPE* key mean, subtracted as
    RoPE(μ, p) at each key's position p."""

    def __init__(
        self,
        num_slots,
        num_heads,
        head_dim,
        device,
        parts: list[TurboQuantizer],
        channels: Optional[torch.Tensor],
        mean: Optional[torch.Tensor] = None,
        rope_mean: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> None:
        super().__init__(num_slots, num_heads, head_dim, device)
        self.parts = [p.to(device) for p in parts]
        self.channels = channels  # (H, D) channel order, outliers first; None = identity / not yet chosen
        self.mean = None if mean is None else mean.to(device)  # (H, D) calibrated channel mean, a constant
        self.rope_mean = None if rope_mean is None else (rope_mean[0].to(device), rope_mean[1])
        self.uses_positions = self.rope_mean is not None
        self.store = []
        for p in self.parts:
            s = {"norm": torch.zeros(num_slots, num_heads, dtype=torch.float16, device=device)}
            if p.mse_bits:
                s["idx"] = torch.zeros(
                    num_slots, num_heads, bitpack.packed_size(p.dim, p.mse_bits), dtype=torch.uint8, device=device
                )
            if p.variant == "prod":
                s["signs"] = torch.zeros(num_slots, num_heads, p.dim // 8, dtype=torch.uint8, device=device)
                s["res_norm"] = torch.zeros(num_slots, num_heads, dtype=torch.float16, device=device)
            self.store.append(s)

    def _split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """(..., H, D) → per part (..., H, d_part) in the stored channel order."""
        if self.channels is not None:
            x = torch.gather(x, -1, self.channels.expand(*x.shape[:-2], -1, -1))
        return list(torch.split(x, [p.dim for p in self.parts], dim=-1))

    def _merge(self, parts: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(parts, dim=-1)
        if self.channels is None:
            return x
        return torch.empty_like(x).scatter_(-1, self.channels.expand(*x.shape[:-2], -1, -1), x)

    def _rotated_mean(self, positions: torch.Tensor) -> torch.Tensor:
        """RoPE(μ, p) for every position (T,) → (T, H, D), by the layer's own rotary embedding."""
        mu, rope = self.rope_mean
        return rope(mu.expand(positions.shape[0], -1, -1), positions)

    def write(self, x, slots, positions=None):
        if self.rope_mean is not None:
            x = x - self._rotated_mean(positions)
        elif self.mean is not None:
            x = x - self.mean
        if self.channels is None and len(self.parts) > 1:  # documented fallback: calibrate on first write
            self.channels = outlier_order(x, self.parts[0].dim)
        for p, s, xp in zip(self.parts, self.store, self._split(x)):
            c = p.quantize(xp)
            s["norm"].index_copy_(0, slots, c.norm)
            if c.idx is not None:
                s["idx"].index_copy_(0, slots, bitpack.pack(c.idx, p.mse_bits))
            if c.signs is not None:
                s["signs"].index_copy_(0, slots, bitpack.pack(c.signs.long(), 1))
                s["res_norm"].index_copy_(0, slots, c.res_norm)

    def _codes(self, i: int, slots: torch.Tensor, head_major: bool) -> TQCodes:
        p, s = self.parts[i], self.store[i]
        tr = (lambda t: t.transpose(0, 1)) if head_major else (lambda t: t)
        idx = bitpack.unpack(tr(s["idx"][slots]), p.mse_bits, p.dim) if p.mse_bits else None
        c = TQCodes(tr(s["norm"][slots]), idx)
        if p.variant == "prod":
            c.signs = bitpack.unpack(tr(s["signs"][slots]), 1, p.dim).bool()
            c.res_norm = tr(s["res_norm"][slots])
        return c

    def decode(self, slots, positions=None):
        x = self._merge([p.dequantize(self._codes(i, slots, False)) for i, p in enumerate(self.parts)])
        if self.rope_mean is not None:
            return x + self._rotated_mean(positions)
        return x if self.mean is None else x + self.mean

    def prepare_query(self, qg):
        """Per part (Rq, SRq), q·μ (H, G) for a constant mean, and for a pre-RoPE mean the two (H, G, D/2)
        factors of q·RoPE(μ, p) = Σ_i cos(p θ_i)(q1 μ1 + q2 μ2)_i + sin(p θ_i)(q2 μ1 − q1 μ2)_i."""
        qmu = None if self.mean is None else torch.einsum("hgd,hd->hg", qg, self.mean)
        rope_terms = None
        if self.rope_mean is not None:
            q1, q2 = qg.chunk(2, dim=-1)
            m1, m2 = (m[:, None, :] for m in self.rope_mean[0].chunk(2, dim=-1))
            rope_terms = (q1 * m1 + q2 * m2, q2 * m1 - q1 * m2)
        return [p.prepare_query(qp) for p, qp in zip(self.parts, self._split_heads(qg))], qmu, rope_terms

    def _split_heads(self, qg: torch.Tensor) -> list[torch.Tensor]:
        """(H, G, D) queries → per part (H, G, d_part) in the stored channel order."""
        if self.channels is not None:
            qg = torch.gather(qg, -1, self.channels[:, None, :].expand(-1, qg.shape[1], -1))
        return list(torch.split(qg, [p.dim for p in self.parts], dim=-1))

    def scores(self, prepared, slots, positions=None):
        parts, qmu, rope_terms = prepared
        s = sum(p.scores(prep, self._codes(i, slots, True)) for i, (p, prep) in enumerate(zip(self.parts, parts)))
        if rope_terms is not None:  # the pre-RoPE mean's share of each score, at each key's position
            freqs = positions.float()[:, None] * self.rope_mean[1].inv_freq[None, :]  # (L, D/2)
            s = s + rope_terms[0] @ freqs.cos().T + rope_terms[1] @ freqs.sin().T
        return s if qmu is None else s + qmu[..., None]

    def weighted_sum(self, p, slots):
        """Accumulate in rotated coordinates; :meth:`finish` rotates back once per query."""
        return torch.cat([torch.bmm(p, q.rotated(self._codes(i, slots, True))) for i, q in enumerate(self.parts)], -1)

    def finish(self, acc):
        parts = torch.split(acc, [p.dim for p in self.parts], dim=-1)
        out = torch.cat([a @ p.R for a, p in zip(parts, self.parts)], dim=-1)  # (H, G, D)
        if self.channels is not None:
            out = torch.empty_like(out).scatter_(-1, self.channels[:, None, :].expand(-1, out.shape[1], -1), out)
        return out if self.mean is None else out + self.mean[:, None, :]  # the weights sum to one

    def page_spec(self) -> TurboQuantPageSpec:
        """These pages as the native kernels read them in place (inner-product parts with their signs, residual norms
        and sketch); built once per channel order (the rotations copied to row-major once, not per step)."""
        cached = getattr(self, "_spec", None)
        if cached is not None and cached.channels is self.channels:
            return cached
        parts = [
            TurboQuantPart(
                p.dim, p.mse_bits, p.R, p.codebook, s["norm"], s.get("idx"), s.get("signs"), s.get("res_norm"), p.S
            )
            for p, s in zip(self.parts, self.store)
        ]
        mean = None if self.mean is None else self.mean.float().contiguous()
        rope_mean = inv_freq = None
        if self.rope_mean is not None:  # keys calibrated with a pre-RoPE mean (rotated by the layer's own RoPE)
            mu, rope = self.rope_mean
            rope_mean, inv_freq = mu.float().contiguous(), rope.inv_freq.float().contiguous()
        self._spec = TurboQuantPageSpec(parts, self.channels, mean, rope_mean, inv_freq)
        return self._spec

    def native_pages(self):
        """("turboquant", None, None, :meth:`page_spec`) when the native attention reads these pages: 1 or 2 parts,
        each with MSE codes, the outlier channels chosen (by calibration or the first write)."""
        if (
            len(self.parts) > 2
            or any(not p.mse_bits for p in self.parts)
            or (len(self.parts) > 1 and self.channels is None)
        ):
            return None
        return "turboquant", None, None, self.page_spec()

    def step_objection(self) -> Optional[str]:
        """None when the native decode step reads and writes these pages (the MSE variant, 1 or 2 parts, head_dim up
        to ops.TQ_MAX_HEAD_DIM), else why not, in one line."""
        if any(p.variant != "mse" for p in self.parts):
            read = (
                "its attention on the codec's own read (a part of 1-bit keys keeps no MSE codes, which the kernel "
                "needs)"
                if any(p.mse_bits == 0 for p in self.parts)
                else "its attention native"
            )
            return (
                "turboquant_prod keys (1-bit QJL residual) have no native step (it does not write them; the MSE "
                f"variant, turboquant, has); the module path runs, {read}"
            )
        if self.head_dim > ops.TQ_MAX_HEAD_DIM:
            return f"TurboQuant pages of head dim {self.head_dim} (the native step reads up to {ops.TQ_MAX_HEAD_DIM})"
        if len(self.parts) > 2:
            return f"TurboQuant pages of {len(self.parts)} parts (the native step reads 1 or 2)"
        return None

    def step_ready(self) -> bool:
        """False until two-part pages know their outlier channels (calibration, or the first write picks them)."""
        return len(self.parts) < 2 or self.channels is not None

    def step_side(self):
        """(("turboquant", None, None, :meth:`page_spec`), "") or (None, :meth:`step_objection`)."""
        objection = self.step_objection()
        return (None, objection) if objection else (("turboquant", None, None, self.page_spec()), "")

    def tensors(self):
        return [t for s in self.store for t in s.values()]


def outlier_order(samples: torch.Tensor, n_outliers: int) -> torch.Tensor:
    """samples (..., H, D) → (H, D) channel order: the n_outliers largest mean-square channels first."""
    ms = samples.float().pow(2).reshape(-1, *samples.shape[-2:]).mean(0)  # (H, D)
    order = torch.argsort(ms, dim=-1, descending=True)
    out, rest = order[:, :n_outliers].sort(-1).values, order[:, n_outliers:].sort(-1).values
    return torch.cat([out, rest], -1)


def split_order(ranking: torch.Tensor, n_outliers: int) -> torch.Tensor:
    """(H, D) channels by decreasing importance → channel order: the top n_outliers, then the rest (each sorted)."""
    return torch.cat([ranking[:, :n_outliers].sort(-1).values, ranking[:, n_outliers:].sort(-1).values], -1)


class TurboQuantHalf(HalfCodec):
    """One of K or V stored with TurboQuant; optional calibration (per layer) of

    * the channel mean μ (H, D): k − μ is quantized. Exact for attention: a key's score gains q·μ, the same
      for every key of a query, which is added back on codes (and a softmax would not see it anyway); a value
      mean comes out of the weighted sum unchanged because the weights sum to one;
    * for keys, when calibration gives the positions and the layer's RoPE: the mean of the keys *before*
      RoPE, μ_pre, subtracted as RoPE(μ_pre, p) at each key's position p. Post-RoPE, a constant channel mean
      only captures the slowly rotating channel pairs; the pre-RoPE mean is constant in every pair (KVQuant's
      observation, arXiv 2401.18079 §3.1), and removing it leaves 1.5–2.5× less key energy to quantize on
      SmolLM2 (attention KL −35 %, bench/KV_RESULTS.md §1b). Exact: the score gains q·RoPE(μ_pre, p), added
      back on codes per key position;
    * the channel ranking (H, D) that picks the outlier channels (keys: centred variance × mean square of the
      queries reading the channel, i.e. the expected score error; values: centred variance);
    * the layout (:func:`choose_layout`), one for all layers, from the mean importance profile.
    """

    head_state = ("ranking", "means", "rope_means")  # per-KV-head calibration state, sliced per tensor-parallel rank
    needs_calibration = True  # uncalibrated, keys with outlier channels can collapse (bench/KV_RESULTS.md §13)

    def __init__(self, bits: float, variant: str, rotation: str) -> None:
        self.bits, self.variant, self.rotation = bits, variant, rotation
        self.name = f"turboquant{'_prod' if variant == 'prod' else ''}{bits:g}" + (":qr" if rotation == "qr" else "")
        self.ranking: dict[int, torch.Tensor] = {}  # layer → (H, D) channels by decreasing importance
        self.means: dict[int, torch.Tensor] = {}  # layer → (H, D) channel mean
        self.rope_means: dict[int, tuple] = {}  # layer → (μ_pre (H, D), the layer's RotaryEmbedding)
        self.profiles: dict[int, torch.Tensor] = {}  # layer → (D,) sorted importance fractions (mean over heads)

    def layout(self, head_dim: int):
        profiles = [p for p in self.profiles.values() if p.shape[0] == head_dim]
        profile = torch.stack(profiles).mean(0) if profiles else None
        return choose_layout(self.bits, head_dim, self.variant, profile)

    def check(self, num_heads, head_dim, block_size):
        self.layout(head_dim)

    def describe(self, head_dim: Optional[int] = None) -> str:
        """At a given head dim, the layout, each part's rotation and the calibration state, e.g.
        ``turboquant3.5 [96 ch × 4 b qr + 160 ch × 3 b qr; hadamard needs a power of two, qr used; calibrated]``."""
        if head_dim is None:
            return self.name
        layout = self.layout(head_dim)
        kinds = [rotation_kind(n, self.rotation) for n, _ in layout]
        notes = [" + ".join(f"{n} ch × {b} b {k}" for (n, b), k in zip(layout, kinds))]
        if any(k != self.rotation for k in kinds):
            notes.append("hadamard needs a power of two, qr used")
        if self.profiles:
            notes.append("calibrated" + (", pre-RoPE key mean" if self.rope_means else ""))
        else:
            notes.append("uncalibrated: no mean" + (", outliers from the first prefill" if len(layout) > 1 else ""))
        return f"{self.name} [{'; '.join(notes)}]"

    def bytes_per_token(self, num_heads, head_dim):
        return num_heads * layout_bits(self.layout(head_dim), self.variant) / 8

    def create(self, layer, role, num_blocks, block_size, num_heads, head_dim, device):
        if not self.profiles and device != "meta":
            warnings.warn(
                f"{self.name} runs uncalibrated (no channel mean, outlier channels from the first prefill): "
                "on models with key outliers its error can be many times the calibrated one. Calibrate it: "
                "--kv-calib-windows 1 (generate, serve, eval), or "
                "bytediet.calibrate.kv.calibrate_codec(codec, model, windows)",
                UserWarning,
                stacklevel=2,
            )
        layout = self.layout(head_dim)
        seed = 7919 * layer + (0 if role == "k" else 104729)
        parts = [TurboQuantizer(n, b, self.variant, self.rotation, seed + 17 * i) for i, (n, b) in enumerate(layout)]
        ranking = self.ranking.get(layer)
        channels = None if ranking is None or len(parts) == 1 else split_order(ranking, layout[0][0]).to(device)
        return TurboQuantPages(
            num_blocks * block_size,
            num_heads,
            head_dim,
            device,
            parts,
            channels,
            self.means.get(layer),
            self.rope_means.get(layer),
        )

    def calibrate(
        self,
        samples: torch.Tensor,
        layer: int,
        queries: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        rope=None,
    ) -> None:
        """samples (N, H, D) of this half's vectors for ``layer``; queries (N, Hq, D) weight key channels;
        positions (N,) and ``rope`` (the layer's RotaryEmbedding) of key samples give the pre-RoPE mean."""
        x = samples.float().reshape(-1, *samples.shape[-2:])
        if rope is not None and positions is not None and bool((positions >= 0).all()) and x.shape[-1] % 2 == 0:
            pos = positions.reshape(-1)
            mu_pre = rope.inverse(x, pos).mean(0)  # (H, D)
            self.rope_means[layer] = (mu_pre, rope)
            self.means.pop(layer, None)
            centred = x - rope(mu_pre.expand(pos.shape[0], -1, -1), pos)
        else:
            mean = x.mean(0)  # (H, D)
            self.means[layer] = mean
            self.rope_means.pop(layer, None)
            centred = x - mean
        importance = centred.pow(2).mean(0)  # (H, D)
        if queries is not None:
            h = x.shape[1]
            q = queries.float().reshape(-1, h, queries.shape[-2] // h, queries.shape[-1])
            importance = importance * q.pow(2).mean((0, 2))
        self.ranking[layer] = torch.argsort(importance, dim=-1, descending=True)
        frac = importance.sort(-1, descending=True).values
        self.profiles[layer] = (frac / frac.sum(-1, keepdim=True).clamp(min=1e-30)).mean(0)

    def calibration_state(self):
        """Per layer: channel ranking, importance profile, and the channel mean (post-RoPE) or the pre-RoPE mean
        (its RoPE is the model's own, handed back to :meth:`load_calibration_state` as ``rope``)."""
        if not self.profiles:
            return None
        return {
            "ranking": dict(self.ranking),
            "profiles": dict(self.profiles),
            "means": dict(self.means),
            "rope_means": {layer: mu for layer, (mu, _) in self.rope_means.items()},
        }

    def load_calibration_state(self, state, rope=None):
        self.ranking = layer_map(state["ranking"], lambda x: torch.as_tensor(x, dtype=torch.long))
        self.profiles = layer_map(state["profiles"])
        self.means = layer_map(state.get("means", {}))
        rope_means = layer_map(state.get("rope_means", {}))
        if rope_means and rope is None:
            raise ConfigError(
                f"{self.name}: the calibration state holds pre-RoPE key means; load it with the "
                "model's rotary embeddings (rope=model.rope)"
            )
        self.rope_means = {layer: (mu, rope(layer)) for layer, mu in rope_means.items()}


_SPEC = re.compile(r"^(\d+(?:\.\d+)?)(?::(hadamard|qr))?$")


class TurboQuantCodec(CompressedCodec):
    variant = "mse"

    def __init__(self, bits: float = 3.5, rotation: str = "hadamard") -> None:
        if not MIN_BITS <= bits <= MAX_BITS:
            raise ConfigError(f"turboquant bits must be in [{MIN_BITS:g}, {MAX_BITS:g}] (all-in), got {bits:g}")
        prefix = "turboquant_prod" if self.variant == "prod" else "turboquant"
        super().__init__(
            f"{prefix}{bits:g}" + (":qr" if rotation == "qr" else ""),
            TurboQuantHalf(bits, self.variant, rotation),
            TurboQuantHalf(bits, "mse", rotation),
        )

    @classmethod
    def from_spec(cls, rest: str) -> "TurboQuantCodec":
        if not rest:
            return cls()
        m = _SPEC.match(rest)
        if not m:
            raise ConfigError(f"bad TurboQuant spec parameters {rest!r}: expected <bits>[:qr], e.g. 3.5 or 2.5:qr")
        return cls(float(m.group(1)), m.group(2) or "hadamard")

    def calibrate(
        self, k_samples: torch.Tensor, v_samples: torch.Tensor, layer: int, queries: Optional[torch.Tensor] = None
    ) -> None:
        """Calibrate ``layer`` from keys/values (N, H, D) and optionally the queries (N, Hq, D) that read them."""
        self.key_half.calibrate(k_samples, layer, queries=queries)
        self.value_half.calibrate(v_samples, layer)


KV_CODECS.register("turboquant")(TurboQuantCodec)


@KV_CODECS.register("turboquant_prod")
class TurboQuantProdCodec(TurboQuantCodec):
    variant = "prod"
