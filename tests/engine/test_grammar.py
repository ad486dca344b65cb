"""Grammar masks: only tokens that keep the output inside the grammar survive; a bad schema is a ConfigError."""
from __future__ import annotations

import json

import pytest
import torch

from bytediet.engine.grammar import GrammarCompiler
from bytediet.errors import ConfigError


class Letters:
    """A raw-string vocabulary: 0 = EOS, then one token per character of ``{}[]":, abcxyz0123456789truefalsn``."""

    CHARS = '{}[]":, abcxyz0123456789tfruelsn'
    eos_token_ids = frozenset({0})

    def decode(self, ids, skip_special_tokens=False):
        return "".join("</s>" if i == 0 else self.CHARS[i - 1] for i in ids)

    def encode(self, text):
        return [self.CHARS.index(c) + 1 for c in text]


V = len(Letters.CHARS) + 1
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def greedy_under_mask(mask, prefer: str, steps: int = 30) -> str:
    """Each step the most preferred allowed token wins: ``prefer``'s characters first, in order."""
    tok, out = Letters(), []
    order = torch.arange(V, 0, -1, dtype=torch.float32)
    for _ in range(steps):
        logits = torch.full((V,), -5.0)
        for rank, c in enumerate(prefer):
            logits[tok.encode(c)[0]] = float(len(prefer) - rank)
        logits = mask(out, logits + order * 1e-3)
        nxt = int(logits.argmax())
        if nxt == 0:
            break
        out.append(nxt)
    return tok.decode(out)


def test_the_mask_keeps_output_valid_against_the_schema():
    mask = GrammarCompiler(Letters(), V).json_mask(SCHEMA)
    text = greedy_under_mask(mask, prefer="xyz}")  # letters are never valid here; "}" closes as soon as it may
    value = json.loads(text)
    assert set(value) == {"a"} and isinstance(value["a"], int) and mask.is_completed


def test_first_token_must_open_an_object():
    mask = GrammarCompiler(Letters(), V).json_mask(None)
    row = mask([], torch.zeros(V))
    allowed = {Letters().decode([i]) for i in range(V) if row[i] > float("-inf")}
    assert allowed == {"{"}


def test_a_schema_that_cannot_compile_is_a_config_error():
    with pytest.raises(ConfigError, match="response_format"):
        GrammarCompiler(Letters(), V).json_mask({"type": "object", "properties": {"a": {"type": "nonsense"}}})
