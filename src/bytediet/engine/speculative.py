"""Speculative decoding: drafts proposed beside the scheduler, verified by the target model in one step.

A request that speculates carries up to ``k`` draft tokens into its next step; the target scores its last token
and the drafts together (one pass over the weights, ``1 + k`` query rows of one sequence), and
:func:`verify` keeps the longest prefix the target agrees with plus one token of its own:

* temperature 0: a draft is kept while it is the target's argmax, so the text equals plain greedy decoding;
* sampling: rejection sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318).
  A prompt-lookup draft is a point mass q = δ(x): x is kept with probability p(x), and on rejection the token is
  drawn from p with x removed, renormalised — max(0, p − q) — so every emitted token follows the target's p.

The KV the step wrote for rejected drafts is rolled back by the scheduler (computed count and block table back
to the accepted length). Proposals come from the text itself (**prompt lookup**, :class:`NgramProposer`): the
sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) looked up earlier in the
sequence, and the tokens that followed them there. :class:`AdaptiveDraft` lowers a request's k when its drafts are
rejected, to 0 when they do not pay (at the cost of a draft row this engine measured, :class:`VerifyCosts`), and
probes again later; a batch of more than :class:`BatchLimit` decoding sequences (``disable_by_batch_size``, else
where this machine's roofline says a verifying step stops being memory-bound) does not speculate. A **draft
model** (any smaller model with the target's tokenizer, :class:`DraftModelProposer`) drafts greedily instead.

Requests with penalties, logits processors (structured output) or prompt logprobs do not speculate: each of
their rows would need the state after the drafts before it.
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..errors import ConfigError
from ..kernels import reference
from .params import SamplingParams

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
#: the most decoding sequences that speculate when neither the config nor this machine's roofline says
DEFAULT_BATCH_LIMIT = 8


@dataclass(frozen=True)
class BatchLimit:
    """Above ``sequences`` decoding sequences a step does not speculate; ``source`` says who decided: "config",
    "roofline" (the most sequences whose verifying step, ``rows`` query rows in all, stays memory-bound on this
    machine's measured ceilings) or "default"."""

    sequences: int
    source: str
    rows: Optional[int] = None

    @classmethod
    def of(cls, config: "SpeculativeConfig") -> "BatchLimit":
        if config.disable_by_batch_size is not None:
            return cls(config.disable_by_batch_size, "config")
        return cls(DEFAULT_BATCH_LIMIT, "default")

    @classmethod
    def from_roofline(cls, sequences: int, num_speculative_tokens: int) -> "BatchLimit":
        """``sequences`` memory-bound verifying sequences of 1 + k rows; at least one (a lone sequence's drafts are
        priced by the measured row cost, :class:`VerifyCosts`)."""
        return cls(max(1, sequences), "roofline", sequences * (1 + num_speculative_tokens))

    def to_dict(self) -> dict:
        return {"sequences": self.sequences, "source": self.source, "memory_bound_rows": self.rows}


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` JSON: ``{"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_min": 2, "prompt_lookup_max": 4}`` or ``{"method": "draft_model", "model": PATH, ...}``."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: Optional[str] = None
    # more decoding sequences than this: no speculation (compute-bound steps); None: where the roofline of this
    # machine says the verifying step stops being memory-bound (the commands seed it), else DEFAULT_BATCH_LIMIT
    disable_by_batch_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative config: method {self.method!r} is unknown; choose {' or '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"speculative config: num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ConfigError(
                f"speculative config: prompt_lookup_min ({lo!r}) and prompt_lookup_max ({hi!r}) must be "
                "integers with 1 <= prompt_lookup_min <= prompt_lookup_max"
            )
        if self.method == "draft_model" and not self.model:
            raise ConfigError('speculative config: method draft_model needs "model": the draft model\'s path or name')
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ConfigError(
                f"speculative config: disable_by_batch_size must be a positive integer (or left out: the roofline's "
                f"limit), got {limit!r}"
            )

    @classmethod
    def parse(cls, value: Any) -> Optional["SpeculativeConfig"]:
        """A config from JSON text, a dict, a config, or None (no speculation)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"--speculative-config is not valid JSON ({exc.msg}); write e.g. "
                    '\'{"method": "ngram", "num_speculative_tokens": 4}\''
                ) from None
        if not isinstance(value, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative config: unknown field(s) {unknown}; known: {', '.join(sorted(known))}")
        return cls(**value)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def eligible(params: SamplingParams) -> bool:
    """Whether a request with these parameters may speculate (its rows need no state beyond the text)."""
    return not (params.has_penalties or params.logits_processors or params.prompt_logprobs is not None)


class NgramProposer:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the sequence's last n tokens."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose_many(self, work: Sequence[tuple[Sequence[int], int]]) -> list[list[int]]:
        return [self.propose(tokens, k) for tokens, k in work]

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` (empty when no n-gram recurs); vectorised, so a long
        context costs microseconds a step, not a Python scan."""
        if k <= 0:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        n_tok = arr.shape[0]
        for n in range(min(self.lookup_max, n_tok - 1), self.lookup_min - 1, -1):
            match = np.ones(n_tok - n, dtype=bool)  # match[s]: tokens[s:s+n] equals the tail (s < n_tok − n)
            for j in range(n):
                match &= arr[j : n_tok - n + j] == arr[n_tok - n + j]
            hits = np.flatnonzero(match)
            if hits.size:  # the most recent earlier occurrence
                start = int(hits[-1])
                return arr[start + n : start + n + k].tolist()
        return []


#: the cost of one more draft row in a verifying step, as a fraction of a one-token step, until measured
#: (:class:`VerifyCosts`; SmolLM2 on 2 cores: a 5-row step costs ~1.8 one-row steps, spec_bench_s12_k4.json)
DRAFT_ROW_COST = 0.2
#: the predicted gain a draft must reach to be proposed: a margin for the cost model's error (open prompts at an
#: acceptance of 0.31 were predicted 1.09× and measured 0.90–0.94×, bench/results/spec_bench_s12_k*_costaware.json)
MIN_GAIN = 1.15


def expected_gain(acceptance: float, k: int, row_cost: float = DRAFT_ROW_COST) -> float:
    """Tokens a verifying step with ``k`` drafts yields per plain-step cost: E = (1 − a^(k+1)) / (1 − a) tokens (each
    draft kept with probability a, independently) over 1 + row_cost·k."""
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a) / (1 + row_cost * k)


class VerifyCosts:
    """The measured cost of a draft row: times of steps that ran one decoding sequence alone (the forward, the
    verification, the text and the next drafts), by its query rows (1 + drafts), the median of the last ``keep`` of
    each; one more row's cost as a fraction of a plain step is the least-squares slope through the plain step's
    time. :data:`DRAFT_ROW_COST` until a plain step and a verifying step have both been timed."""

    def __init__(self, keep: int = 16, refit_every: int = 8) -> None:
        self.keep, self.refit_every = keep, refit_every
        self._times: dict[int, deque] = {}
        self._cost: Optional[float] = None  # the last fit, refitted after a new row count or refit_every steps
        self._unfitted = 0

    def observe(self, rows: int, seconds: float) -> None:
        if rows not in self._times:
            self._times[rows] = deque(maxlen=self.keep)
            self._cost = None
        self._times[rows].append(seconds)
        self._unfitted += 1

    @property
    def rows_timed(self) -> list[int]:
        return sorted(self._times)

    def row_cost(self) -> float:
        """Asked every step: the fit is kept between refits (medians every step cost 3 % of a 135M model's step)."""
        if self._cost is None or self._unfitted >= self.refit_every:
            self._cost, self._unfitted = self._fit(), 0
        return self._cost

    def _fit(self) -> float:
        plain = self._times.get(1)
        wider = [(r, statistics.median(t)) for r, t in self._times.items() if r > 1]
        if not plain or not wider:
            return DRAFT_ROW_COST
        t1 = statistics.median(plain)
        slope = sum((r - 1) * (t - t1) for r, t in wider) / sum((r - 1) ** 2 for r, _ in wider)
        return max(slope / t1, 0.0) if t1 > 0 else DRAFT_ROW_COST


@dataclass
class AdaptiveDraft:
    """A request's draft length: the k ≤ ``k`` that maximises :func:`expected_gain` at the exponential average of its
    accepted fraction and the measured cost of a draft row (:class:`VerifyCosts`); 0 when no k beats a plain step by
    :data:`MIN_GAIN`, then a probe of one token every ``probe_every`` steps."""

    k: int
    acceptance: float = 0.6
    probe_every: int = 16
    idle: int = 0
    proposed: int = 0
    accepted: int = 0

    def length(self, row_cost: float = DRAFT_ROW_COST) -> int:
        gains = [(expected_gain(self.acceptance, k, row_cost), k) for k in range(1, self.k + 1)]
        gain, k = max(gains)
        if gain > MIN_GAIN:
            return k
        self.idle += 1
        return 1 if self.idle % self.probe_every == 0 else 0

    def update(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.proposed += proposed
            self.accepted += accepted
            self.acceptance = 0.7 * self.acceptance + 0.3 * accepted / proposed


@dataclass
class Verdict:
    """What verification kept: the accepted drafts followed by the target's own token, and each one's row."""

    tokens: list[int]
    rows: list[int] = field(default_factory=list)  # the logits row of each kept token

    @property
    def accepted_drafts(self) -> int:
        return len(self.tokens) - 1


def verify(
    logits: torch.Tensor, drafts: Sequence[int], params: SamplingParams, sampler, generator: Optional[torch.Generator]
) -> Verdict:
    """logits (1 + len(drafts), V): the target's rows at the last token and at each draft. Greedy: drafts kept while
    they are the argmax; sampling: rejection sampling against the point-mass draft (see the module doc)."""
    n = len(drafts)
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()
        kept = 0
        while kept < n and best[kept] == drafts[kept]:
            kept += 1
        return Verdict(list(drafts[:kept]) + [best[kept]], list(range(kept + 1)))
    probs = sampler.processed_probs(logits.float(), [params] * (n + 1))  # (n + 1, V), the target's p per row
    gen = generator if generator is not None else sampler.generator
    for j, x in enumerate(drafts):
        u = float(torch.rand(1, generator=gen, dtype=torch.float64, device=gen.device))
        px = float(probs[j, x])
        if u < px:  # accepted with probability min(1, p(x) / q(x)) = p(x)
            continue
        residual = probs[j].clone()  # max(0, p − δ_x): x removed, renormalised by the draw
        residual[x] = 0.0
        return Verdict(list(drafts[:j]) + [_draw(residual, gen)], list(range(j + 1)))
    return Verdict(list(drafts) + [_draw(probs[n], gen)], list(range(n + 1)))


def _draw(p: torch.Tensor, gen: torch.Generator) -> int:
    """One token from the (unnormalised) distribution p (V,), by one uniform of ``gen``."""
    u = torch.rand(1, generator=gen, dtype=torch.float64, device=gen.device).to(p.device)
    return int(reference.inverse_cdf(p.unsqueeze(0), u)[0])


class DraftModelProposer:
    """Drafts from a smaller model with the same tokenizer: its own engine decodes ``k`` tokens greedily after each
    sequence's text. Each proposal is a new draft request whose prompt is the text so far, so the draft engine's
    prefix cache keeps what it computed before and only the tokens since its last full block are prefilled again
    (rejected drafts need no rollback there). A greedy draft is a point mass, which :func:`verify` expects."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def propose_many(self, work: Sequence[tuple[Sequence[int], int]]) -> list[list[int]]:
        """[(tokens, k)] → drafts, all sequences drafted together (continuous batching in the draft engine)."""
        ids = []
        for tokens, k in work:
            if k <= 0:
                ids.append(None)
                continue
            req = self.engine.add_request(list(tokens), SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True))
            ids.append(req)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        out = []
        for req in ids:
            out.append([] if req is None else list(req.output_token_ids))
            if req is not None:
                self.engine.forget(req.request_id)
        return out


def check_same_tokenizer(target, draft) -> None:
    """Refuse a draft model whose tokenizer differs from the target's (its drafts would be other tokens)."""
    vocab = [getattr(t, "get_vocab", lambda: None)() for t in (target, draft)]
    if vocab[0] is not None and vocab[1] is not None:
        same = vocab[0] == vocab[1]
    else:
        probe = "The quick brown fox, 12 ½ times: naïve café."
        same = all(hasattr(t, "encode") for t in (target, draft)) and target.encode(
            probe, add_special_tokens=False
        ) == draft.encode(probe, add_special_tokens=False)
    if not same:
        raise ConfigError(
            'speculative config: "model" (the draft model) has another tokenizer than the target; '
            "a draft model must share the target's tokenizer (e.g. a smaller model of the same family)"
        )


def make_proposer(config: SpeculativeConfig, target_tokenizer=None, num_threads: Optional[int] = None):
    """The proposer of ``config.method`` (a draft model is loaded here, with a small KV pool of its own)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from ..kvcache.config import CacheConfig
    from ..models.loader import load_model
    from .config import EngineConfig
    from .engine import LLMEngine

    model, tokenizer = load_model(config.model, keep_packed=True)
    check_same_tokenizer(target_tokenizer, tokenizer)
    engine_config = EngineConfig(
        model=config.model, cache=CacheConfig(kv_cache_memory="256MiB"), num_threads=num_threads
    )
    return DraftModelProposer(LLMEngine(model, tokenizer, engine_config))
