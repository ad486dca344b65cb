"""Per-request sampling parameters, with vLLM's field names, defaults and meanings.

Every field is checked in ``__post_init__``; the checks that need the model (token ids, the
number of logprobs) live in :meth:`SamplingParams.validate`, which the engine calls with the
vocabulary size before it queues the request. A bad value raises
:class:`bytediet.errors.ConfigError` whose message names the field and the allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Optional

from ..errors import ConfigError

_SEED_MASK = (1 << 64) - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request (vLLM ``SamplingParams`` semantics).

    Args:
        n: completions returned for the prompt (each one is an independent sequence).
        max_tokens: most tokens generated per completion; ``None`` runs to the end of the
            context window (the engine enforces that bound).
        temperature: logits are divided by it; ``0`` means greedy (argmax, no randomness).
        top_k: keep the ``k`` most likely tokens; ``-1`` or ``0`` turns it off.
        top_p: nucleus sampling, keep the smallest most-likely set with mass >= ``top_p``
            (Holtzman et al. 2020, https://arxiv.org/abs/1904.09751); ``1`` turns it off.
        min_p: drop tokens whose probability is below ``min_p`` times the top probability
            (Nguyen et al. 2024, https://arxiv.org/abs/2407.01082); ``0`` turns it off.
        repetition_penalty: CTRL's penalty (Keskar et al. 2019, https://arxiv.org/abs/1909.05858)
            on every token seen in the prompt or the output; ``1`` turns it off.
        presence_penalty: OpenAI's flat penalty on tokens present in the output, in [-2, 2].
        frequency_penalty: OpenAI's per-occurrence penalty on output tokens, in [-2, 2].
        seed: seeds this request's own random generator, so its text does not depend on which
            other requests share the batch. With ``n > 1`` the i-th completion uses ``seed + i``.
        stop: strings that end generation when they appear in the output text.
        stop_token_ids: token ids that end generation (kept in the token ids, not the text).
        ignore_eos: keep generating after the end-of-sequence token.
        logprobs: return the log-probability of each sampled token and of the ``logprobs``
            most likely tokens; ``0`` returns only the sampled token's, ``None`` nothing.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        skip_special_tokens: leave special tokens out of the detokenized text.
        prompt_logprobs: also return, for each prompt token after the first, its log-probability given
            the tokens before it and the ``prompt_logprobs`` most likely tokens there (vLLM's field; what
            OpenAI's legacy ``echo`` + ``logprobs`` reports). Such a request skips the prefix cache: every
            prompt position must be computed to be scored.
        logits_processors: callables ``(output_token_ids, logits (V,)) -> logits (V,)`` applied to this
            sequence's row before sampling (e.g. a grammar mask, :mod:`bytediet.engine.grammar`). They may
            keep per-sequence state, so give each sequence its own; they are not serialised by ``to_dict``.
    """

    n: int = 1
    max_tokens: Optional[int] = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: Optional[int] = None
    logits_processors: tuple[Callable, ...] = field(default=(), compare=False, repr=False)

    # Below this temperature a request is sampled greedily (vLLM's _SAMPLING_EPS).
    GREEDY_EPS = 1e-5

    def __post_init__(self) -> None:
        self._check_ints()
        self._check_floats()
        self._check_stops()
        for key in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} must be true or false, got {getattr(self, key)!r}")

    def _check_ints(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ConfigError(f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ConfigError(f"max_tokens must be an integer >= 1 (or null for no limit), got {self.max_tokens!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ConfigError(f"top_k must be an integer >= 1, or -1 / 0 to disable it, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ConfigError(f"seed must be an integer or null, got {self.seed!r}")
        for key in ("logprobs", "prompt_logprobs"):
            value = getattr(self, key)
            if value is not None and (not _is_int(value) or value < 0):
                raise ConfigError(f"{key} must be an integer >= 0 (or null for none), got {value!r}")

    def _check_floats(self) -> None:
        checks = {
            # field: (predicate on a finite float, allowed range in words)
            "temperature": (lambda v: v >= 0.0, ">= 0 (0 means greedy)"),
            "top_p": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
            "min_p": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
            "repetition_penalty": (lambda v: v > 0.0, "> 0 (1 means off)"),
            "presence_penalty": (lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
            "frequency_penalty": (lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
        }
        for key, (ok, allowed) in checks.items():
            value = getattr(self, key)
            if not _is_number(value) or not math.isfinite(value) or not ok(float(value)):
                raise ConfigError(f"{key} must be a number {allowed}, got {value!r}")
            object.__setattr__(self, key, float(value))

    def _check_stops(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ConfigError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        ids = tuple(self.stop_token_ids or ())
        if any(not _is_int(t) or t < 0 for t in ids):
            raise ConfigError(f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", ids)
        procs = tuple(self.logits_processors or ())
        if any(not callable(p) for p in procs):
            raise ConfigError("logits_processors must be callables (output_ids, logits) -> logits")
        object.__setattr__(self, "logits_processors", procs)

    def validate(self, vocab_size: int) -> None:
        """Checks that need the model: every stop token id and ``logprobs`` fit the vocabulary."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ConfigError(
                    f"stop_token_ids: token id {t} is outside the vocabulary; ids must be in [0, {vocab_size - 1}]"
                )
        for key in ("logprobs", "prompt_logprobs"):
            value = getattr(self, key)
            if value is not None and value > vocab_size:
                raise ConfigError(f"{key} must be in [0, {vocab_size}] (the vocabulary size), got {value}")

    # ---- derived facts ----------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature < self.GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def generator_seed(self, index: int = 0) -> Optional[int]:
        """Seed of the ``index``-th completion's generator (``seed + index``, as vLLM v1), or None."""
        return None if self.seed is None else (self.seed + index) & _SEED_MASK

    def for_completion(self, index: int) -> "SamplingParams":
        """The params of one of the ``n`` completions: ``n = 1`` and its own seed."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)

    # ---- serialisation ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "logits_processors"}
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        """Inverse of :meth:`to_dict`; an unknown key is an error that lists the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown sampling field(s) {', '.join(unknown)}; known fields: {', '.join(sorted(known))}"
            )
        return cls(**data)
