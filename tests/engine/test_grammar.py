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


@pytest.mark.parametrize("kind", ["integer", "number"])
def test_an_unbounded_number_stops_at_16_digits(kind):
    """A model that always prefers another digit cannot run away: the value ends after 16 digits."""
    schema = {"type": "object", "properties": {"a": {"type": kind}}, "required": ["a"], "additionalProperties": False}
    mask = GrammarCompiler(Letters(), V).json_mask(schema)
    text = greedy_under_mask(mask, prefer='{"a:9}', steps=60)
    value = json.loads(text)
    assert len(str(int(value["a"]))) == 16 and mask.is_completed


def test_bound_numbers_keeps_given_bounds_and_data():
    from bytediet.engine.grammar import NUMBER_BOUND, bound_numbers

    schema = {
        "type": "object",
        "properties": {
            "n": {"type": ["integer", "null"]},
            "b": {"type": "integer", "minimum": 0},
            "e": {"enum": [{"type": "integer"}]},
            "items": {"type": "array", "items": {"type": "number"}},
        },
    }
    out = bound_numbers(schema)
    props = out["properties"]
    assert props["n"]["maximum"] == NUMBER_BOUND and props["n"]["minimum"] == -NUMBER_BOUND
    assert props["b"] == {"type": "integer", "minimum": 0}
    assert props["e"] == {"enum": [{"type": "integer"}]}
    assert props["items"]["items"]["maximum"] == NUMBER_BOUND
    assert schema["properties"]["n"] == {"type": ["integer", "null"]}  # the caller's schema is not changed
