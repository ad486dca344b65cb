"""Long-context retrieval: the passkey test, a needle in a haystack of real prose.

Format of Mohtashami & Jaggi 2023, "Landmark Attention: Random-Access Infinite Context Length for
Transformers" (https://arxiv.org/abs/2305.16300), App. "passkey retrieval", with Austen text as
the haystack instead of a repeated sentence (as in Kamradt's "needle in a haystack" test):

    <task sentence>\\n\\n<filler ... "The pass key is 48213. Remember it. 48213 is the pass key." ... filler>
    \\n\\nWhat is the pass key? The pass key is

``depth`` is the fraction of the filler placed before the passkey sentence (0: right after the
task sentence, 1: right before the question); the insertion point is moved back to the nearest
sentence end so the key is not spliced into a word.  A trial succeeds when the greedy
continuation (a few tokens) contains the key's digits.  The prompt is fixed: it is not tuned to
favour any configuration.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from ..errors import ConfigError

TASK = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there."
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8  # enough for a 5-digit key and a little slack
_SNAP_RANGE = 48  # tokens searched backwards for a sentence end


@dataclass(frozen=True)
class PasskeyPrompt:
    """One trial: prompt ids, the key, where the needle starts (token index) and the requested length."""

    ids: list[int]
    key: str
    needle_start: int
    length: int
    depth: float


def _sentence_end(tokenizer, filler: Sequence[int], pos: int) -> int:
    """The largest ``p <= pos`` (within a short range) such that ``filler[p-1]`` ends a sentence or line."""
    for p in range(pos, max(0, pos - _SNAP_RANGE), -1):
        text = tokenizer.decode([filler[p - 1]]) if p > 0 else ""
        if text.rstrip(" ").endswith((".", "!", "?", "\n", '"')):
            return p
    return pos


def build_prompt(
    tokenizer, filler_ids: torch.Tensor, length: int, depth: float, key: str, offset: int = 0
) -> PasskeyPrompt:
    """A prompt of exactly ``length`` tokens (BOS included when the tokenizer adds one).

    ``filler_ids`` (N,) is a tokenized text; the haystack is ``filler_ids[offset : offset + n]``
    with ``n`` whatever the fixed parts leave.  Raises :class:`ConfigError` if ``length`` is too
    short for the fixed parts or the filler text too short.
    """
    head = tokenizer.encode(TASK + "\n\n", add_special_tokens=True)
    needle = tokenizer.encode(NEEDLE.format(key=key), add_special_tokens=False)
    tail = tokenizer.encode(QUESTION, add_special_tokens=False)
    n_filler = length - len(head) - len(needle) - len(tail)
    if n_filler < 0:
        raise ConfigError(
            f"passkey length {length} is shorter than the fixed prompt "
            f"({len(head) + len(needle) + len(tail)} tokens); use a longer length"
        )
    if offset + n_filler > len(filler_ids):
        raise ConfigError(
            f"the filler text has {len(filler_ids)} tokens, {offset + n_filler} needed; "
            "use a longer corpus or shorter passkey lengths"
        )
    filler = filler_ids[offset : offset + n_filler].tolist()
    cut = _sentence_end(tokenizer, filler, round(depth * n_filler))
    ids = head + filler[:cut] + needle + filler[cut:] + tail
    return PasskeyPrompt(ids, key, len(head) + cut, length, depth)


def answer_contains(text: str, key: str) -> bool:
    """Success test: the key's digits appear in the generated text."""
    return key in text


def make_trials(
    tokenizer, filler_ids: torch.Tensor, lengths: Sequence[int], depths: Sequence[float], trials: int, seed: int = 0
) -> list[PasskeyPrompt]:
    """Seeded prompts for every (length, depth, trial): a fresh 5-digit key and filler offset each."""
    rng = random.Random(seed)
    prompts = []
    for length in lengths:
        for depth in depths:
            for _ in range(trials):
                key = str(rng.randrange(10000, 100000))
                offset = rng.randrange(0, max(1, len(filler_ids) - length))
                prompts.append(build_prompt(tokenizer, filler_ids, length, depth, key, offset))
    return prompts


def clip_lengths(lengths: Sequence[int], max_len: int) -> list[int]:
    """Requested lengths limited to the model's context (minus the answer tokens), deduplicated, sorted."""
    limit = max_len - ANSWER_TOKENS
    return sorted({min(int(n), limit) for n in lengths})


def run_passkey(
    llm, prompts: Sequence[PasskeyPrompt], progress: Optional[Callable[[Sequence, str], Iterator]] = None
) -> dict:
    """Greedy-generate an answer for every prompt with ``llm`` (:class:`bytediet.engine.llm.LLM`).

    Returns ``{"accuracy", "trials", "cells": [{"length", "depth", "accuracy", "trials"}],
    "answers": [{"length", "depth", "key", "answer", "ok"}]}``.
    """
    from ..engine.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS)
    progress = progress or (lambda items, desc: iter(items))
    answers = []
    for p in progress(prompts, "passkey"):  # one at a time: CPU prefill gains nothing from batching
        text = llm.generate([p.ids], params)[0].outputs[0].text
        answers.append(
            {"length": p.length, "depth": p.depth, "key": p.key, "answer": text, "ok": answer_contains(text, p.key)}
        )
    if not answers:
        raise ConfigError("no passkey trials: give at least one length and one depth")
    cells = {}
    for a in answers:
        cells.setdefault((a["length"], a["depth"]), []).append(a["ok"])
    return {
        "accuracy": sum(a["ok"] for a in answers) / len(answers),
        "trials": len(answers),
        "cells": [
            {"length": n, "depth": d, "accuracy": sum(v) / len(v), "trials": len(v)}
            for (n, d), v in sorted(cells.items())
        ],
        "answers": answers,
    }
