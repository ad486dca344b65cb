"""Constrained decoding: a grammar (a JSON Schema, or any JSON value) masks the tokens a sequence may sample.

Compiled with xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured Generation
Engine for Large Language Models", https://arxiv.org/abs/2411.15100): the grammar is a pushdown
automaton whose context-independent tokens are precomputed per state, so filling one step's bitmask
costs tens of microseconds. A :class:`GrammarMask` is one sequence's logits processor
(``SamplingParams.logits_processors``): before each sampled token it feeds the matcher the tokens
sampled since its last call, then sets the logits of every forbidden token to ``-inf``. Once the
grammar is complete only the end-of-sequence tokens remain allowed, so the output always parses.

Why xgrammar (measured on SmolLM2-135M's 49,152-token vocabulary, ``bench/grammar_overhead.py``):
see the server's note; it had the lowest per-token mask time of the libraries tried.
"""

from __future__ import annotations

import json
import threading
from functools import lru_cache
from typing import Optional, Sequence

import torch

from ..errors import ConfigError


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise ConfigError("structured output needs the xgrammar package: pip install xgrammar") from exc
    return xgrammar


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's view of the vocabulary: each id's encoded string and how to turn it into bytes.

    A bytediet ``Tokenizer`` (a ``tokenizers`` backend) is detected as byte-level BPE or SentencePiece
    byte-fallback from its own JSON, as xgrammar does for Hugging Face tokenizers; any other tokenizer
    is read token by token with ``decode`` (raw strings). ``vocab_size`` is the model's (the logits'
    width), which may exceed the tokenizer's.
    """
    xgr = _xgrammar()
    stop = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:
        vocab = [""] * vocab_size
        for token, idx in backend.get_vocab(with_added_tokens=True).items():
            if idx < vocab_size:
                vocab[idx] = token
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        return xgr.TokenizerInfo(
            vocab,
            vocab_type=meta["vocab_type"],
            vocab_size=vocab_size,
            stop_token_ids=stop,
            add_prefix_space=meta["add_prefix_space"],
        )
    vocab = [tokenizer.decode([i]) for i in range(vocab_size)]
    return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)


#: the bound given to an integer or number the schema leaves unbounded: 16 digits, as llama.cpp's JSON grammar
NUMBER_BOUND = 10**16 - 1
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_DATA_KEYS = ("enum", "const", "default", "examples")  # JSON values, not schemas


def bound_numbers(schema):
    """A copy of ``schema`` whose unbounded ``integer`` / ``number`` types are bounded by ±NUMBER_BOUND, so a small
    model cannot emit digits until ``max_tokens``; a bound the schema gives is kept."""
    if isinstance(schema, list):
        return [bound_numbers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYS else bound_numbers(v) for k, v in schema.items()}
    kinds = out.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if ("integer" in kinds or "number" in kinds) and not any(b in out for b in _BOUNDS):
        out.update(minimum=-NUMBER_BOUND, maximum=NUMBER_BOUND)
    return out


class GrammarCompiler:
    """Compiles grammars for one tokenizer; compiled grammars are cached by their schema text."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._lock = threading.Lock()  # requests compile from the server's worker threads
        self.compile_json = lru_cache(maxsize=64)(self._compile_json)

    def _compile_json(self, schema_text: Optional[str]):
        with self._lock:
            try:
                if schema_text is None:  # any JSON object (OpenAI's json_object)
                    return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
                return self._compiler.compile_json_schema(schema_text, any_whitespace=False, strict_mode=True)
            except (RuntimeError, ValueError) as exc:
                raise ConfigError(f"response_format: the JSON schema cannot be compiled: {exc}") from None

    def json_mask(self, schema: Optional[dict]) -> "GrammarMask":
        """A fresh mask (one per sequence) for values matching ``schema`` (``None``: any JSON object); integers and
        numbers without bounds get ±(10^16 − 1) (:func:`bound_numbers`)."""
        text = None if schema is None else json.dumps(bound_numbers(schema))  # key order: the properties' order
        return GrammarMask(self.compile_json(text), self.vocab_size, text)


class GrammarMask:
    """One sequence's grammar state; call it as ``mask(output_ids, logits)`` before each sampled token."""

    def __init__(self, compiled, vocab_size: int, schema_text: Optional[str] = None) -> None:
        xgr = _xgrammar()
        self.schema_text = schema_text  # what it was compiled from (an engine process compiles its own copy)
        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # (1, ceil(V / 32)) int32
        self.seen = 0

    def __call__(self, output_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (V,) with every token the grammar forbids after ``output_ids`` set to ``-inf``."""
        for token in output_ids[self.seen :]:
            if not self.matcher.is_terminated() and not self.matcher.accept_token(int(token)):
                raise RuntimeError(f"grammar mask: token {token} was sampled although the grammar forbids it")
        self.seen = len(output_ids)
        self.matcher.fill_next_token_bitmask(self.bitmask)
        row = logits.unsqueeze(0)
        self._xgr.apply_token_bitmask_inplace(row, self.bitmask.to(logits.device))
        return row[0]

    @property
    def is_completed(self) -> bool:
        return self.matcher.is_completed()
