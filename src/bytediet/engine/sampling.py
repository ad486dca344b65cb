"""The sampler: one batched pass from logits to next tokens, with per-request parameters.

Order of the steps (vLLM's): penalties → temperature → top-k → top-p → min-p → sample.
Every step is one tensor operation over the whole batch ``(B, V)``; only the random draws
loop over the rows, so that each row draws from its own generator: a request with a seed
gets the same tokens whether it runs alone or beside any other requests.

Sampling is inverse transform sampling with one uniform per row (what ``torch.multinomial``
does for one sample), so a sampled row consumes exactly one number of its generator's stream.

Logprobs are reported, like vLLM's default (``logprobs_mode="raw_logprobs"``), under the
*raw model distribution*: ``log_softmax`` of the logits as the model produced them, before
penalties, temperature and truncation. Greedy rows consume no randomness.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from ..kernels import ops
from .params import SamplingParams

TokenIds = Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities that come with one sampled token.

    ``rank`` is 1 + the number of tokens strictly more likely than the sampled one;
    ``top`` holds the requested number of ``(token_id, logprob)`` pairs, most likely first.
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class SamplerOutput:
    """``token_ids`` (B,) int64; ``logprobs[i]`` is None where row ``i`` asked for none."""

    token_ids: torch.Tensor
    logprobs: list[Optional[TokenLogprobs]]


def make_generator(seed: Optional[int], device: torch.device | str = "cpu") -> Optional[torch.Generator]:
    """A generator seeded once for a seeded request (the engine keeps it on the request), else None."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed & ((1 << 64) - 1))
    return g


def pad_token_ids(token_lists: Sequence[TokenIds], pad: int, device: torch.device | str) -> torch.Tensor:
    """Ragged token id lists → one (B, L) int64 matrix, short rows filled with ``pad`` (L >= 1)."""
    rows = [t.tolist() if isinstance(t, torch.Tensor) else list(t) for t in token_lists]
    width = max([len(r) for r in rows] + [1])
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def apply_penalties(
    logits: torch.Tensor,
    seen_ids: torch.Tensor,
    output_ids: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Repetition (CTRL, https://arxiv.org/abs/1909.05858, on prompt and output tokens) and
    presence / frequency (OpenAI, on output tokens only, as vLLM).

    logits (B, V) float; ``seen_ids`` (B, S) the prompt and output ids, ``output_ids`` (B, O)
    the output ids, both padded with V; penalties (B,). Returns a new tensor.
    A seen token's logit ``l`` becomes ``l / r`` if ``l > 0`` else ``l * r``; then every
    token loses ``frequency * count + presence * (count > 0)`` (count over the output).
    Only the listed tokens are touched (gather / scatter), never the whole vocabulary: a token
    listed twice is written twice with the same value.
    """
    B, V = logits.shape
    x = torch.cat([logits, logits.new_zeros(B, 1)], dim=1)  # column V absorbs the padding
    r = repetition.unsqueeze(1)
    seen = x.gather(1, seen_ids)
    x.scatter_(1, seen_ids, torch.where(seen > 0, seen / r, seen * r))
    x.scatter_add_(1, output_ids, (-frequency).unsqueeze(1).expand(output_ids.shape).contiguous())
    x.scatter_(1, output_ids, x.gather(1, output_ids) - presence.unsqueeze(1))
    return x[:, :V]


# Top-p looks at the most likely tokens first; when they hold the nucleus (the usual case) a
# partial top-k replaces a full sort of the vocabulary, which is ~10x slower on the CPU.
NUCLEUS_CANDIDATES = 1024


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]
) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k, then outside the nucleus of mass top_p.

    logits (B, V); top_k (B,) int64 in [1, V] (V = off); top_p (B,) in (0, 1] (1 = off).
    Ties at the boundary are all kept: top-k keeps every token whose logit is >= the k-th
    largest; top-p keeps token t iff the mass of tokens strictly more likely than t is < p,
    computed on the distribution renormalised after top-k (Holtzman et al. 2020,
    https://arxiv.org/abs/1904.09751).
    """
    B, V = logits.shape
    k = top_k if top_k is not None else torch.full((B,), V, dtype=torch.long, device=logits.device)
    p = top_p if top_p is not None else torch.ones(B, dtype=torch.float32, device=logits.device)
    k_on, p_on = k < V, p < 1.0
    width = max([int(k[k_on].max())] if bool(k_on.any()) else [1])
    if bool((p_on & ~k_on).any()):
        width = max(width, NUCLEUS_CANDIDATES)
    if width >= V:
        return _mask_top_k_top_p(logits, torch.sort(logits, dim=-1, descending=True), k_on, k, p_on, p, full=True)
    return _mask_top_k_top_p(logits, torch.topk(logits, width, dim=-1), k_on, k, p_on, p, full=False)


def _mask_top_k_top_p(logits, candidates, k_on, k, p_on, p, full: bool) -> torch.Tensor:
    """``candidates`` = (values, indices) (B, W), most likely first; W = V when ``full``."""
    values, indices = candidates
    neg_inf = torch.tensor(float("-inf"), device=logits.device)
    W = values.shape[1]
    kth = values.gather(1, (k.clamp(max=W) - 1).unsqueeze(1))  # (B, 1)
    kth = torch.where(k_on.unsqueeze(1), kth, neg_inf)
    logits = logits.masked_fill(logits < kth, float("-inf"))
    if not bool(p_on.any()):
        return logits
    values = values.masked_fill(values < kth, float("-inf"))
    probs = logits.softmax(dim=-1).gather(1, indices)  # (B, W): mass under the whole renormalised row
    cum = probs.cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)  # monotone prefix sums
    last = (mass_before < p.unsqueeze(1)).sum(dim=1, keepdim=True) - 1  # index of the last kept token
    threshold = torch.where(p_on.unsqueeze(1), values.gather(1, last), neg_inf)
    out = logits.masked_fill(logits < threshold, float("-inf"))
    spill = p_on & (cum[:, -1] < p) if not full else torch.zeros_like(p_on)
    if bool(spill.any()):  # these nuclei reach past the candidates: sort those rows in full (rare)
        rows = spill.nonzero().flatten()
        sub = logits[rows]
        out[rows] = _mask_top_k_top_p(
            sub, torch.sort(sub, dim=-1, descending=True), k_on[rows], k[rows], p_on[rows], p[rows], full=True
        )
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens with probability < min_p * (top probability); logits (B, V), min_p (B,)
    (Nguyen et al. 2024, https://arxiv.org/abs/2407.01082)."""
    # p_t / p_max = exp(l_t - l_max), so the test needs no softmax; log(0) = -inf masks nothing
    floor = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < floor, float("-inf"))


def draw_uniforms(generators: Sequence[torch.Generator], device: torch.device | str) -> torch.Tensor:
    """One U[0, 1) float64 per row, row ``b`` drawn from ``generators[b]`` only: (B,) on ``device``.

    Each number is drawn on its generator's own device and then moved, so CPU generators serve
    GPU logits, and a seed gives the same uniforms whichever device runs the model.
    """
    draws = [torch.rand(1, generator=g, dtype=torch.float64, device=g.device).to(device) for g in generators]
    return torch.cat(draws) if draws else torch.empty(0, dtype=torch.float64, device=device)


class Sampler:
    """Turns the logits of the rows that sample into next tokens (and logprobs on request).

    ``generator`` is the engine's shared generator, used in row order by unseeded requests;
    without one, a generator on ``device`` seeded with ``seed`` is made. Per-request generators
    (see :func:`make_generator`) may live on any device: a sampled row draws one number from
    its generator, on the generator's device.
    """

    def __init__(
        self, generator: Optional[torch.Generator] = None, seed: int = 0, device: torch.device | str = "cpu"
    ) -> None:
        self.generator = generator if generator is not None else make_generator(seed, device)

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_ids: Optional[Sequence[TokenIds]] = None,
        output_ids: Optional[Sequence[TokenIds]] = None,
        generators: Optional[Sequence[Optional[torch.Generator]]] = None,
    ) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: (B, V) raw model logits (any float dtype; computed in float32).
            params: B sampling params, one per row.
            prompt_ids / output_ids: B token id lists (needed only when a row has penalties).
            generators: B per-request generators (None for unseeded rows → the shared one).
        """
        B, V = logits.shape
        if len(params) != B:
            raise ValueError(f"got {len(params)} sampling params for {B} rows of logits")
        raw = logits.float()
        x = self._penalise(raw, params, prompt_ids, output_ids)
        x = self._process(x, raw, params, output_ids)
        tokens = torch.empty(B, dtype=torch.long, device=x.device)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        if greedy_rows:
            tokens[greedy_rows] = _rows(x, greedy_rows).argmax(dim=-1)
        if sample_rows:
            rows, row_params = _rows(x, sample_rows), [params[i] for i in sample_rows]
            u = draw_uniforms([self._generator_for(i, generators) for i in sample_rows], x.device)
            if any(_truncates(p, V) for p in row_params):
                scaled, inv_t = self.processed_logits(rows, row_params), torch.ones(len(sample_rows))
            else:  # temperature alone: the kernel scales the raw logits as it reads them
                scaled, inv_t = rows, torch.tensor([1.0 / p.temperature for p in row_params], dtype=torch.float32)
            tokens[sample_rows] = ops.sample_rows(scaled, inv_t.to(x.device), u).to(x.device)
        return SamplerOutput(tokens, self._logprobs(raw, tokens, params))

    @staticmethod
    def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """The distribution sampled from, after temperature, top-k, top-p and min-p: (B, V) float32.

        ``logits`` (B, V) are already penalised; every row must be non-greedy.
        """
        return Sampler.processed_logits(logits, params).softmax(dim=-1)

    @staticmethod
    def processed_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """The logits after temperature, top-k, top-p and min-p (tokens cut off at -inf): (B, V) float32."""
        B, V = logits.shape
        dev = logits.device
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        x = logits / temperature.unsqueeze(1)
        ks = [p.top_k if 0 < p.top_k < V else V for p in params]
        top_k = torch.tensor(ks, dtype=torch.long, device=dev) if any(k < V for k in ks) else None
        top_p = None
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        if top_k is not None or top_p is not None:
            x = apply_top_k_top_p(x, top_k, top_p)
        if any(p.min_p > 0.0 for p in params):
            x = apply_min_p(x, torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev))
        return x

    def _penalise(self, logits, params, prompt_ids, output_ids) -> torch.Tensor:
        if not any(p.has_penalties for p in params):
            return logits
        if prompt_ids is None or output_ids is None:
            raise ValueError("penalties need prompt_ids and output_ids for every row")
        B, V = logits.shape
        dev = logits.device

        def col(name: str) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=dev)

        seen = [list(a) + list(b) for a, b in zip(prompt_ids, output_ids)]
        return apply_penalties(
            logits,
            pad_token_ids(seen, V, dev),
            pad_token_ids(output_ids, V, dev),
            col("repetition_penalty"),
            col("presence_penalty"),
            col("frequency_penalty"),
        )

    @staticmethod
    def _process(x: torch.Tensor, raw: torch.Tensor, params, output_ids) -> torch.Tensor:
        """Each row's ``logits_processors`` (grammar masks) on its (V,) row; ``raw`` stays the model's logits."""
        rows = [i for i, p in enumerate(params) if p.logits_processors]
        if not rows:
            return x
        if output_ids is None:
            raise ValueError("logits processors need output_ids for every row")
        x = x.clone() if x is raw else x  # logprobs are reported under the unmasked model distribution
        for i in rows:
            for proc in params[i].logits_processors:
                x[i] = proc(output_ids[i], x[i])
        return x

    def _generator_for(self, row: int, generators) -> torch.Generator:
        g = generators[row] if generators is not None else None
        return g if g is not None else self.generator

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, params) -> list[Optional[TokenLogprobs]]:
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        out: list[Optional[TokenLogprobs]] = [None] * len(params)
        if not want:
            return out
        scored = token_logprobs(_rows(raw, want), tokens[want], max(params[i].logprobs for i in want))
        for i, lp in zip(want, scored):
            out[i] = replace(lp, top=lp.top[: params[i].logprobs])
        return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> list[TokenLogprobs]:
    """Each row's log-probability of its token, rank, and ``num_top`` most likely tokens.

    ``logits`` (N, V) raw model logits, ``tokens`` (N,) the token each row scores: the sampled one, or
    the next prompt token (prompt logprobs). Under the raw model distribution (``log_softmax``).
    """
    lp = logits.float().log_softmax(dim=-1)  # (N, V)
    chosen_lp = lp.gather(1, tokens.unsqueeze(1))  # (N, 1)
    ranks = (lp > chosen_lp).sum(dim=1) + 1
    top_lp, top_ids = lp.topk(num_top, dim=-1) if num_top else (None, None)
    out = []
    for j, token in enumerate(tokens.tolist()):
        top = tuple(zip(top_ids[j].tolist(), top_lp[j].tolist())) if num_top else ()
        out.append(TokenLogprobs(int(token), float(chosen_lp[j, 0]), int(ranks[j]), top))
    return out


def _truncates(p: SamplingParams, vocab: int) -> bool:
    """Whether top-k, top-p or min-p cut this row's distribution."""
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]`` without a copy when ``rows`` is every row in order (the common case)."""
    return x if rows == list(range(x.shape[0])) else x[rows]
