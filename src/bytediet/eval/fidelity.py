"""How far a compressed model's next-token distribution moves from the reference: pure functions of logits.

Notation: for one window, logits ``z`` have shape (L, V) and ``targets`` (L,) int64, where row ``i``
of the logits predicts ``targets[i]`` (for a window of ids (L+1,) that is ``logits[:-1]`` and
``ids[1:]``; see :func:`next_token_pairs`).  Every formula is evaluated in float64 from
``log_softmax`` (``log p_v = z_v - logsumexp(z)``), which is exact-enough and never overflows.

* NLL at position i:      ``nll_i = -log p(targets_i)``;  mean NLL ``= sum_i nll_i / L``.
* Perplexity:             ``PPL = exp(mean NLL)`` (over many windows: exp of the token-weighted mean).
* KL at position i:       ``KL_i(P_ref || P_test) = sum_v p_ref,v * (log p_ref,v - log p_test,v)``,
  with the convention ``0 * log(0 / q) = 0``; rounding negatives are clamped to 0.  This is the
  "KL divergence" statistic of llama.cpp's ``perplexity --kl-divergence`` and of the quantization
  literature (e.g. Dettmers et al. 2022, "LLM.int8()"; Frantar et al. 2023, "GPTQ").
* Top-1 agreement:        fraction of positions with ``argmax z_ref == argmax z_test``.
* Tail statistics:        mean, median (p50), p90, p99 and max of the per-position values; the
  percentiles interpolate linearly between order statistics (numpy's default "linear" method).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from bytediet.errors import ConfigError

COMPARE_CHUNK_ELEMENTS = 1 << 20  # rows compared at a time: 8 MiB float64 chunks, which the heap reuses in place


def _check_logits(logits: torch.Tensor, name: str) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ConfigError(f"{name} must be a floating-point (L, V) tensor, got {tuple(logits.shape)} {logits.dtype}")


def _rows_per_chunk(vocab: int) -> int:
    return max(1, COMPARE_CHUNK_ELEMENTS // max(vocab, 1))


def next_token_pairs(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (L, V) of a window ids (L,) -> (logits[:-1] (L-1, V), ids[1:] (L-1,)): each row with its next token."""
    if logits.shape[0] != ids.shape[0]:
        raise ConfigError(f"{logits.shape[0]} rows of logits for {ids.shape[0]} ids")
    return logits[:-1], ids[1:]


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position negative log-likelihood ``-log softmax(z_i)[targets_i]`` -> (L,) float64."""
    _check_logits(logits, "logits")
    if targets.shape != logits.shape[:1]:
        raise ConfigError(f"targets must have shape ({logits.shape[0]},), got {tuple(targets.shape)}")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.float64)
    step = _rows_per_chunk(vocab)
    for lo in range(0, rows, step):
        logp = torch.log_softmax(logits[lo : lo + step].double(), dim=-1)
        out[lo : lo + step] = -logp.gather(1, targets[lo : lo + step].long().unsqueeze(1)).squeeze(1)
    return out


def mean_nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean next-token NLL in nats: ``sum_i nll_i / L``."""
    return float(token_nll(logits, targets).mean())


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """``exp(mean NLL)``."""
    return math.exp(mean_nll(logits, targets))


def kl_per_position(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> torch.Tensor:
    """``KL(P_ref || P_test)`` at every position -> (L,) float64, in nats (formula in the module doc).

    ``inf`` where the test model gives probability 0 (logit -inf) to a token the reference does not.
    """
    return _compare(ref_logits, test_logits)[0]


def _compare(
    ref_logits: torch.Tensor, test_logits: torch.Tensor, targets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KL per position (L,) and, given targets, NLL (2, L) of [ref, test]: one log-softmax per row."""
    _check_logits(ref_logits, "ref_logits")
    _check_logits(test_logits, "test_logits")
    if ref_logits.shape != test_logits.shape:
        raise ConfigError(f"logit shapes differ: ref {tuple(ref_logits.shape)} vs test {tuple(test_logits.shape)}")
    rows, vocab = ref_logits.shape
    if targets is not None and targets.shape != (rows,):
        raise ConfigError(f"targets must have shape ({rows},), got {tuple(targets.shape)}")
    kl = torch.empty(rows, dtype=torch.float64)
    nll = torch.empty(2, rows, dtype=torch.float64) if targets is not None else None
    step = _rows_per_chunk(vocab)
    for lo in range(0, rows, step):
        lp_ref = torch.log_softmax(ref_logits[lo : lo + step].double(), dim=-1)
        lp_test = torch.log_softmax(test_logits[lo : lo + step].double(), dim=-1)
        p_ref = lp_ref.exp()
        terms = torch.where(p_ref > 0, p_ref * (lp_ref - lp_test), torch.zeros((), dtype=torch.float64))
        kl[lo : lo + step] = terms.sum(dim=-1).clamp_min(0.0)
        if nll is not None:
            idx = targets[lo : lo + step].long().unsqueeze(1)
            nll[0, lo : lo + step] = -lp_ref.gather(1, idx).squeeze(1)
            nll[1, lo : lo + step] = -lp_test.gather(1, idx).squeeze(1)
    return kl, nll


def compare_rows(
    ref_logits: torch.Tensor, test_logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: KL (L,), NLL (2, L) of [ref, test] and top-1 agreement (L,) bool — one chunk of a window."""
    kl, nll = _compare(ref_logits, test_logits, targets)
    return kl, nll, top1_match(ref_logits, test_logits)


def top1_match(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> torch.Tensor:
    """(L,) bool: does the test model's most likely token equal the reference's (first index on ties)?"""
    _check_logits(ref_logits, "ref_logits")
    if ref_logits.shape != test_logits.shape:
        raise ConfigError(f"logit shapes differ: ref {tuple(ref_logits.shape)} vs test {tuple(test_logits.shape)}")
    return ref_logits.argmax(dim=-1) == test_logits.argmax(dim=-1)


def top1_agreement(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> float:
    """Fraction of positions where the two argmax tokens agree."""
    return float(top1_match(ref_logits, test_logits).double().mean())


@dataclass(frozen=True)
class TailStats:
    """Summary of a per-position quantity: mean, p50, p90, p99, max (and how many values)."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: float
    count: int

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def tail_stats(values: torch.Tensor | np.ndarray | list[float]) -> TailStats:
    """Tail statistics of a 1-D set of values (percentiles by linear interpolation)."""
    arr = np.asarray(values.detach().cpu() if isinstance(values, torch.Tensor) else values, dtype=np.float64).reshape(
        -1
    )
    if arr.size == 0:
        raise ConfigError("tail statistics of an empty set of values are undefined; score at least one token")
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return TailStats(float(arr.mean()), float(p50), float(p90), float(p99), float(arr.max()), int(arr.size))


@dataclass(frozen=True)
class WindowResult:
    """One window's numbers (``name`` identifies it, e.g. its start offset in the corpus)."""

    name: str
    tokens: int
    mean_kl: float
    max_kl: float
    top1_agreement: float
    nll_test: float
    nll_ref: float


@dataclass
class FidelityAccumulator:
    """Aggregates NLL/PPL, KL and top-1 agreement over many windows; keeps the ``keep_worst`` worst.

    ``add(test_logits, targets, ref_logits=...)`` per window; ``summary()`` at the end.  Without
    reference logits only the NLL/perplexity of the test model is accumulated.
    """

    keep_worst: int = 5
    _kl: list[torch.Tensor] = field(default_factory=list)
    _worst: list[tuple[float, int, WindowResult]] = field(default_factory=list)
    _nll_test: float = 0.0
    _nll_ref: float = 0.0
    _tokens: int = 0
    _ref_tokens: int = 0
    _matches: int = 0
    _windows: int = 0

    def add(
        self,
        test_logits: torch.Tensor,
        targets: torch.Tensor,
        *,
        ref_logits: torch.Tensor | None = None,
        name: str | None = None,
    ) -> WindowResult | None:
        """Score one window: logits (L, V) whose row i predicts targets[i]. Returns the window's numbers."""
        if targets.numel() == 0:
            raise ConfigError("a window needs at least one scored token (logits for L >= 1 positions)")
        if self._windows and (ref_logits is None) != (self._ref_tokens == 0):
            raise ConfigError("give ref_logits for every window or for none, so that the totals compare alike")
        if ref_logits is None:
            nll_test = token_nll(test_logits, targets)
            self._nll_test += float(nll_test.sum())
            self._tokens += len(nll_test)
            self._windows += 1
            return None
        kl, nll, match = compare_rows(ref_logits, test_logits, targets)
        return self.add_scores(kl, nll[0], nll[1], int(match.sum()), name)

    def add_scores(
        self, kl: torch.Tensor, nll_ref: torch.Tensor, nll_test: torch.Tensor, matches: int, name: str | None = None
    ) -> WindowResult:
        """Score one window from its per-position values (:func:`compare_rows`, over the window's chunks)."""
        if self._windows and self._ref_tokens == 0:
            raise ConfigError("give ref_logits for every window or for none, so that the totals compare alike")
        self._nll_test += float(nll_test.sum())
        self._tokens += len(nll_test)
        self._windows += 1
        self._kl.append(kl)
        self._nll_ref += float(nll_ref.sum())
        self._ref_tokens += len(kl)
        self._matches += matches
        result = WindowResult(
            name if name is not None else str(self._windows - 1),
            len(kl),
            float(kl.mean()),
            float(kl.max()),
            matches / len(kl),
            float(nll_test.mean()),
            float(nll_ref.mean()),
        )
        heapq.heappush(self._worst, (result.mean_kl, -self._windows, result))  # min-heap of the worst
        if len(self._worst) > self.keep_worst:
            heapq.heappop(self._worst)
        return result

    def kl_values(self) -> torch.Tensor:
        """Per-position KL of every window added with reference logits, in order -> (N,) float64."""
        return torch.cat(self._kl) if self._kl else torch.empty(0, dtype=torch.float64)

    def worst(self) -> list[WindowResult]:
        """The kept windows with the largest mean KL, worst first."""
        return [r for _, _, r in sorted(self._worst, key=lambda t: (-t[0], -t[1]))]

    def summary(self) -> dict:
        """JSON-ready totals: ``ppl = exp(total NLL / total tokens)``; KL tail over every scored position."""
        if self._tokens == 0:
            raise ConfigError("no windows were scored; add at least one window before asking for a summary")
        out: dict = {
            "windows": self._windows,
            "tokens": self._tokens,
            "nll_test": self._nll_test / self._tokens,
            "ppl_test": math.exp(self._nll_test / self._tokens),
        }
        if self._ref_tokens:
            nll_ref = self._nll_ref / self._ref_tokens
            out.update(
                nll_ref=nll_ref,
                ppl_ref=math.exp(nll_ref),
                top1_agreement=self._matches / self._ref_tokens,
                kl=tail_stats(torch.cat(self._kl)).as_dict(),
                worst=[asdict(r) for r in self.worst()],
            )
            out["ppl_ratio"] = out["ppl_test"] / out["ppl_ref"]
        return out
