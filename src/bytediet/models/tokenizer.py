"""Tokenizer and chat template from the checkpoint: a GGUF file or a Hugging Face directory.

Encoding and decoding run in Hugging Face ``tokenizers`` (Rust); a GGUF's vocabulary is turned
into one by :mod:`.tokenizer_gguf`. The chat template is rendered with sandboxed jinja2 the way
transformers does (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``strftime_now``).
:class:`IncrementalDecoder` turns a stream of ids into text that only ever grows by whole
characters, for streaming.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Iterable, Optional, Sequence

import tokenizers
from tokenizers import processors

from ..errors import BytedietError, CheckpointError
from .tokenizer_gguf import build_gguf_tokenizer, read_gguf_tokenizer_meta

# llama.cpp's end-of-generation names (llama-vocab.cpp): a chat model ends its turn with one of these.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|endoftext|>",
    "<EOT>",
    "<|end_of_text|>",
    "<｜end▁of▁sentence｜>",
)


class Tokenizer:
    """Text ↔ token ids, special tokens, and the chat template of one checkpoint."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: Optional[int],
        eos_token_id: Optional[int],
        chat_template: Optional[str] = None,
        extra_eos_ids: Iterable[int] = (),
        source: str = "",
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.source = source
        stops = {i for i in (eos_token_id, *extra_eos_ids) if i is not None}
        stops.update(i for i in map(backend.token_to_id, END_OF_TURN_TOKENS) if i is not None)
        self.eos_token_ids: frozenset[int] = frozenset(stops)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_gguf(cls, path_or_reader) -> "Tokenizer":
        """From a GGUF file's metadata; ``path_or_reader`` may be an open ``gguf.GGUFReader`` (saves re-parsing)."""
        meta = read_gguf_tokenizer_meta(path_or_reader)
        return cls(
            build_gguf_tokenizer(meta),
            bos_token_id=meta.bos_token_id,
            eos_token_id=meta.eos_token_id,
            chat_template=meta.chat_template,
            source=str(path_or_reader) if isinstance(path_or_reader, (str, Path)) else "GGUF file",
        )

    @classmethod
    def from_hf_dir(cls, path) -> "Tokenizer":
        """From a Hugging Face directory: ``tokenizer.json``, ``tokenizer_config.json`` (special tokens,
        chat template), ``chat_template.jinja`` and ``generation_config.json`` (extra EOS ids) when present."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise CheckpointError(f"{path} has no tokenizer.json; only fast (tokenizers) checkpoints are supported")
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")

        def token_id(key: str) -> Optional[int]:
            token = config_token(config, key)
            return backend.token_to_id(token) if token else None

        bos_text = config_token(config, "bos_token")
        bos = token_id("bos_token")
        if config.get("add_bos_token") and bos is not None and bos not in backend.encode("").ids:
            # transformers honours the flag even when tokenizer.json's post-processor does not add BOS
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos_text} $A", pair=f"{bos_text} $A {bos_text} $B:1", special_tokens=[(bos_text, bos)]
            )
        extra = generation.get("eos_token_id", [])
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=token_id("eos_token"),
            chat_template=_hf_chat_template(path, config),
            extra_eos_ids=extra if isinstance(extra, list) else [extra],
            source=str(path),
        )

    # ------------------------------------------------------------------ encode / decode

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS is prepended iff the checkpoint asks for it and ``add_special_tokens``.
        Special tokens written in the text (``<|im_start|>``) are always recognized."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self.backend.id_to_token(token_id)

    def incremental_decoder(self, skip_special_tokens: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat

    def _token_text(self, token_id: Optional[int]) -> str:
        return (self.backend.id_to_token(token_id) or "") if token_id is not None else ""

    @cached_property
    def _compiled_template(self):
        if not self.chat_template:
            raise BytedietError(
                f"this checkpoint ({self.source or 'tokenizer'}) has no chat template, so it cannot format chat "
                "messages (it is probably a base, not an instruction-tuned, model); give it a plain text prompt "
                "instead, e.g. `bytediet generate --prompt ...`"
            )
        return _jinja_environment().from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the checkpoint's template, as
        transformers' ``apply_chat_template(..., tokenize=False)`` does. Extra kwargs (``tools``, …)
        reach the template. The result already holds BOS if the template writes it: encode it
        with ``add_special_tokens=False`` then."""
        context = dict(
            tools=None,
            documents=None,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_id),
        )
        context.update(kwargs)
        return self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)


class IncrementalDecoder:
    """Streaming detokenizer: ``push(id)`` returns the text that ``id`` completes, never a partial character.

    A character may span several tokens (byte-level BPE pieces, SentencePiece ``<0xNN>`` byte
    fallbacks); until it is complete the window decodes to a trailing U+FFFD and nothing is
    returned. Each step decodes only a short window (the previous emitted piece plus the new
    ids), so decoders that look at neighbouring tokens stay consistent (the prefix/read offsets
    of Hugging Face text-generation-inference, ``server/text_generation_server/models/model.py``).
    The concatenation of everything returned, after :meth:`flush`, equals ``decode(all ids)`` — except
    where the ids hold invalid UTF-8 in a SentencePiece byte-fallback run: the full decoder turns the whole
    run into U+FFFD, characters it had completed included, while a stream has already sent those (e.g.
    ``<0x00> <0x80>``: "��" in full, "\x00" then "�" streamed).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything returned so far
        self._prefix = 0  # window start: first id of the last emitted piece
        self._read = 0  # ids before this are already in ``text``

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._advance(final=False)

    def extend(self, token_ids: Iterable[int]) -> str:
        self.ids.extend(int(i) for i in token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete or invalid byte sequence at the very end)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        window_text = self._decode(self.ids[self._prefix :])
        if not final and (len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd")):
            return ""
        new = window_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new


def load_tokenizer(path) -> Tokenizer:
    """The tokenizer of a checkpoint: a ``.gguf`` file (or its open ``gguf.GGUFReader``: parsing a
    262k-token vocabulary takes seconds, so pass the loader's), or a Hugging Face directory."""
    if not isinstance(path, (str, os.PathLike)):  # an open gguf.GGUFReader: the loader's, parsed once
        return Tokenizer.from_gguf(path)
    p = Path(path)
    if p.is_dir():
        return Tokenizer.from_hf_dir(p)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return Tokenizer.from_gguf(p)
    raise CheckpointError(f"no tokenizer at {path}: expected a .gguf file or a directory with tokenizer.json")


def config_token(config: dict, key: str) -> Optional[str]:
    """A special token of ``tokenizer_config.json``: a string or an ``AddedToken`` dict."""
    token = config.get(key)
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _hf_chat_template(path: Path, config: dict) -> Optional[str]:
    """``chat_template.jinja`` (new layout), else ``tokenizer_config.json``'s template (a string or named list)."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _raise_exception(message: str):
    raise BytedietError(f"chat template error: {message}")


def _jinja_environment():
    """transformers' template environment: sandboxed, ``trim_blocks``/``lstrip_blocks``, loop controls."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
