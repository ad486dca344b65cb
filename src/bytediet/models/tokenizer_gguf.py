"""A Hugging Face ``tokenizers.Tokenizer`` rebuilt from a GGUF file's ``tokenizer.*`` metadata.

A GGUF carries no ``tokenizer.json``; llama.cpp stores the vocabulary, merges, token types and
flags under its own keys (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md). We map them
onto ``tokenizers`` components, picked by name from two registries:

* ``TOKENIZER_MODELS`` by ``tokenizer.ggml.model``: ``gpt2`` (byte-level BPE, Radford et al. 2019)
  and ``llama`` (SentencePiece BPE with byte fallback, Kudo & Richardson 2018).
* ``BYTE_LEVEL_PRE_TOKENIZERS`` by ``tokenizer.ggml.pre``: how text is cut into words before BPE,
  copied from llama.cpp's ``llama-vocab.cpp`` regex table.

Token types (llama.cpp ``llama_token_type``): 1 normal, 2 unknown, 3 control, 4 user-defined,
5 unused, 6 byte. Control tokens become special added tokens (``<|im_start|>`` encodes as one id
and ``skip_special_tokens`` drops it); user-defined ones become plain added tokens, matched whole in
the raw text as llama.cpp does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter
from typing import Callable, Optional

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from ..errors import CheckpointError
from ..registry import Registry

CONTROL, USER_DEFINED, BYTE = 3, 4, 6
SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's visible space

# GPT-2's word split (llama.cpp spells it without the trailing "|\s+", which splits the same text).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass
class GGUFTokenizerMeta:
    """The ``tokenizer.*`` metadata of one GGUF file (llama.cpp key names without the prefix)."""

    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    scores: Optional[np.ndarray] = None
    merges: Optional[list[str]] = None
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    unknown_token_id: Optional[int] = None
    padding_token_id: Optional[int] = None
    add_bos_token: Optional[bool] = None
    add_eos_token: bool = False
    add_space_prefix: bool = False
    chat_template: Optional[str] = None
    architecture: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def adds_bos(self) -> bool:
        """llama.cpp's default when the flag is absent: SentencePiece vocabularies add BOS, BPE ones do not."""
        return self.add_bos_token if self.add_bos_token is not None else self.model == "llama"


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def _string_array(reader, key: str) -> Optional[list[str]]:
    f = reader.fields.get(key)
    if f is None:
        return None
    parts = f.parts
    return [parts[i].tobytes().decode("utf-8", errors="replace") for i in f.data]


def _numeric_array(reader, key: str) -> Optional[np.ndarray]:
    f = reader.fields.get(key)
    if f is None:
        return None
    return np.concatenate([f.parts[i] for i in f.data]) if f.data else np.zeros(0)


def read_gguf_tokenizer_meta(path_or_reader) -> GGUFTokenizerMeta:
    """Read the tokenizer metadata of a GGUF file (a path or an open ``gguf.GGUFReader``)."""
    import gguf

    reader = path_or_reader if isinstance(path_or_reader, gguf.GGUFReader) else gguf.GGUFReader(path_or_reader)
    tokens = _string_array(reader, "tokenizer.ggml.tokens")
    if not tokens or _field(reader, "tokenizer.ggml.model") is None:
        raise CheckpointError(
            "this GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens are missing); "
            "re-convert it with llama.cpp's convert_hf_to_gguf.py, which embeds the vocabulary"
        )
    types = _numeric_array(reader, "tokenizer.ggml.token_type")
    scalar = lambda name: _field(reader, "tokenizer.ggml." + name)
    return GGUFTokenizerMeta(
        model=scalar("model"),
        pre=scalar("pre") or "default",
        tokens=tokens,
        token_types=[1] * len(tokens) if types is None else types.astype(int).tolist(),
        scores=_numeric_array(reader, "tokenizer.ggml.scores"),
        merges=_string_array(reader, "tokenizer.ggml.merges"),
        bos_token_id=scalar("bos_token_id"),
        eos_token_id=scalar("eos_token_id"),
        unknown_token_id=scalar("unknown_token_id"),
        padding_token_id=scalar("padding_token_id"),
        add_bos_token=scalar("add_bos_token"),
        add_eos_token=bool(scalar("add_eos_token")),
        add_space_prefix=bool(scalar("add_space_prefix")),
        chat_template=_field(reader, "tokenizer.chat_template"),
        architecture=_field(reader, "general.architecture") or "",
    )


TOKENIZER_MODELS: Registry[Callable[[GGUFTokenizerMeta], Tokenizer]] = Registry("GGUF tokenizer model")
BYTE_LEVEL_PRE_TOKENIZERS: Registry[Callable[[], pre_tokenizers.PreTokenizer]] = Registry("GGUF pre-tokenizer")


def build_gguf_tokenizer(meta: GGUFTokenizerMeta) -> Tokenizer:
    """The full pipeline: model + normalizer/pre-tokenizer/decoder, added tokens, BOS/EOS post-processor."""
    try:
        builder = TOKENIZER_MODELS.get(meta.model)
    except KeyError as e:
        raise CheckpointError(f"cannot build the tokenizer of this GGUF file: {e.args[0]}") from None
    tk = builder(meta)
    _add_special_tokens(tk, meta)
    tk.post_processor = _post_processor(meta)
    return tk


def _add_special_tokens(tk: Tokenizer, meta: GGUFTokenizerMeta) -> None:
    vocab = tk.get_vocab()
    control, user = [], []
    for token, kind in zip(meta.tokens, meta.token_types):
        if kind == CONTROL:
            control.append(AddedToken(token, normalized=False, special=True))
        elif kind == USER_DEFINED and token in vocab:  # pure-space pieces were respelled with "▁" and left to BPE
            user.append(AddedToken(token, normalized=False, special=False))
    tk.add_special_tokens(control)
    tk.add_tokens(user)


def _post_processor(meta: GGUFTokenizerMeta) -> processors.PostProcessor:
    """Prepend BOS iff ``add_bos_token`` (append EOS iff ``add_eos_token``)."""
    pre, post, special = [], [], []
    if meta.adds_bos and meta.bos_token_id is not None:
        pre = [meta.tokens[meta.bos_token_id]]
        special.append((pre[0], meta.bos_token_id))
    if meta.add_eos_token and meta.eos_token_id is not None:
        post = [meta.tokens[meta.eos_token_id]]
        special.append((post[0], meta.eos_token_id))
    single = " ".join(pre + ["$A"] + post)
    pair = " ".join(pre + ["$A"] + post + pre + ["$B:1"] + post)
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


# ---------------------------------------------------------------- byte-level BPE ("gpt2")


@TOKENIZER_MODELS.register("gpt2")
def byte_level_bpe(meta: GGUFTokenizerMeta) -> Tokenizer:
    """GPT-2 byte-level BPE: every byte is spelled as a printable character, merges come from the file."""
    if meta.merges is None:
        raise CheckpointError("byte-level BPE GGUF without tokenizer.ggml.merges; re-convert the checkpoint")
    vocab = {token: i for i, token in enumerate(meta.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.merges]
    tk = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    try:
        tk.pre_tokenizer = BYTE_LEVEL_PRE_TOKENIZERS.get(meta.pre)()
    except KeyError as e:
        raise CheckpointError(f"unsupported tokenizer.ggml.pre in this GGUF file: {e.args[0]}") from None
    tk.decoder = decoders.ByteLevel()
    return tk


def _regex_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@BYTE_LEVEL_PRE_TOKENIZERS.register("default")
@BYTE_LEVEL_PRE_TOKENIZERS.register("gpt-2")
def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


@BYTE_LEVEL_PRE_TOKENIZERS.register("smollm")
@BYTE_LEVEL_PRE_TOKENIZERS.register("starcoder")
@BYTE_LEVEL_PRE_TOKENIZERS.register("refact")
@BYTE_LEVEL_PRE_TOKENIZERS.register("codeshell")
def _digits_pre() -> pre_tokenizers.PreTokenizer:
    """llama.cpp: ``\\p{N}`` then the GPT-2 split; HF SmolLM2: ``Digits(individual)`` + ``ByteLevel``."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


@BYTE_LEVEL_PRE_TOKENIZERS.register("llama-bpe")
@BYTE_LEVEL_PRE_TOKENIZERS.register("llama3")
def _llama3_pre() -> pre_tokenizers.PreTokenizer:
    return _regex_then_bytes(LLAMA3_SPLIT)


@BYTE_LEVEL_PRE_TOKENIZERS.register("qwen2")
def _qwen2_pre() -> pre_tokenizers.PreTokenizer:
    return _regex_then_bytes(QWEN2_SPLIT)


# ---------------------------------------------------------------- SentencePiece BPE ("llama")


@TOKENIZER_MODELS.register("llama")
def sentencepiece_bpe(meta: GGUFTokenizerMeta) -> Tokenizer:
    """SentencePiece BPE: " " is spelled "▁", unknown bytes fall back to ``<0xNN>`` tokens.

    llama.cpp's converter writes pieces of only spaces (Gemma's user-defined "  ", "   ", …) with
    real spaces; they are spelled back with "▁" so BPE can build them from the normalized text.
    """
    tokens = [SPIECE_SPACE * len(t) if t and t.strip(" ") == "" else t for t in meta.tokens]
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = sentencepiece_merges(tokens, meta.token_types, meta.scores)
    unk = meta.tokens[meta.unknown_token_id] if meta.unknown_token_id is not None else None
    tk = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    decoder = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.add_space_prefix:
        # llama.cpp prefixes a space to every text run that starts the input or follows a special
        # token (``is_prev_special`` in llama_vocab::tokenize); text runs between added tokens are
        # normalized one by one, so Prepend does exactly that. The decoder drops the first one.
        tk.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPIECE_SPACE), normalizers.Replace(" ", SPIECE_SPACE)]
        )
        decoder.append(decoders.Strip(" ", 1, 0))
    else:
        tk.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    tk.decoder = decoders.Sequence(decoder)
    return tk


def sentencepiece_merges(tokens: list[str], types: list[int], scores: Optional[np.ndarray]) -> list[tuple[str, str]]:
    """Recover BPE merges from a SentencePiece vocabulary (no merge list is stored).

    SentencePiece BPE merges the adjacent pair whose concatenation has the best score; so every
    split ``a + b = t`` of a piece ``t`` into two vocabulary pieces is a merge of ``t``'s rank, ties
    broken by the longer left part (as transformers' ``generate_merges``). The rank is the score;
    when the file lists pieces in score order, which llama.cpp does, the file position is used
    instead, because user-defined pieces (Gemma's "▁▁") carry a placeholder score of -1000 there.
    Control and byte tokens take no part: they are never produced by merging.
    """
    types_arr = np.asarray(types)
    normal = types_arr == 1
    if scores is None or np.all(np.diff(scores[normal]) <= 0):
        rank = np.arange(len(tokens), dtype=np.float64)
    else:
        rank = -np.asarray(scores, dtype=np.float64)
    rank_of = rank.tolist()
    mergeable = ((types_arr != CONTROL) & (types_arr != BYTE)).tolist()
    pieces = {t: i for i, t in enumerate(tokens) if mergeable[i]}
    candidates = []  # (rank, -len(left), left, right)
    for t, i in pieces.items():
        r = rank_of[i]
        for k in range(1, len(t)):
            left = t[:k]
            if left in pieces:
                right = t[k:]
                if right in pieces:
                    candidates.append((r, -k, left, right))
    candidates.sort(key=itemgetter(0, 1))
    return [(c[2], c[3]) for c in candidates]
