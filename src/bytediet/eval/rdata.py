"""Read R's binary serialization and lazy-load databases with the standard library only.

Format reference: R Internals, section 1.8 "Serialization Formats", and R's own
``src/main/serialize.c`` (``ReadItem``, ``InStringVec``, ``R_decompress1..3``).  An XDR stream is

    b"X\\n"  int version (2 or 3)  int writer_version  int min_reader_version
             [v3 only: int n, n bytes native encoding name]
    item

and every item starts with a 32-bit big-endian ``flags`` word:
``type = flags & 0xFF``, ``is_object = bit 8``, ``has_attr = bit 9``, ``has_tag = bit 10``,
``levels = flags >> 12`` (for CHARSXP the encoding bits: LATIN1 4, UTF8 8, BYTES 2, ASCII 64).

A lazy-load database (``Rdata.rdb`` + ``Rdata.rdx``) stores each object as its own compressed
serialization at ``(offset, length)`` in the ``.rdb``; the ``.rdx`` is an RDS file (gzip + the
stream above) holding ``list(variables = list(name = c(offset, length)), references, compressed)``.

Decoded values: character vectors -> ``RObject("character", [str | None, ...])`` (``None`` = NA),
numeric / integer / logical / raw / complex vectors, lists (VECSXP), pairlists, symbols
(:class:`RSymbol`), environments (:class:`REnvironment`) and ALTREP compact sequences,
deferred strings and wrappers (expanded to their ordinary value).
"""
from __future__ import annotations

import bz2
import gzip
import lzma
import math
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bytediet.errors import BytedietError

# SEXP type codes (Rinternals.h) and the pseudo-types used only in serialization (serialize.c).
NILSXP, SYMSXP, LISTSXP, ENVSXP, LANGSXP = 0, 1, 2, 4, 6
CHARSXP, LGLSXP, INTSXP, REALSXP, CPLXSXP, STRSXP, DOTSXP = 9, 10, 13, 14, 15, 16, 17
VECSXP, EXPRSXP, RAWSXP = 19, 20, 24
ALTREP_SXP, ATTRLISTSXP, ATTRLANGSXP, BASEENV_SXP, EMPTYENV_SXP = 238, 239, 240, 241, 242
BASENAMESPACE_SXP, PERSISTSXP, NAMESPACESXP, PACKAGESXP = 247, 248, 249, 250
MISSINGARG_SXP, UNBOUNDVALUE_SXP, GLOBALENV_SXP, NILVALUE_SXP, REFSXP = 251, 252, 253, 254, 255

NA_INTEGER = -(2**31)
_NA_REAL_LOW_WORD = 1954  # R's NA_real_ is a NaN whose low 32 bits are 1954
_LATIN1, _UTF8, _BYTES = 1 << 2, 1 << 3, 1 << 1

_VECTOR_KINDS = {LGLSXP: "logical", INTSXP: "integer", REALSXP: "double", CPLXSXP: "complex",
                 STRSXP: "character", VECSXP: "list", EXPRSXP: "expression", RAWSXP: "raw"}
_SINGLETONS = {BASEENV_SXP: "baseenv", EMPTYENV_SXP: "emptyenv", GLOBALENV_SXP: "globalenv",
               BASENAMESPACE_SXP: "base namespace", MISSINGARG_SXP: "missing arg",
               UNBOUNDVALUE_SXP: "unbound value"}


class RDataError(BytedietError):
    """The bytes are not an R serialization this reader understands."""


@dataclass
class RObject:
    """An R vector or pairlist: ``kind`` is R's ``typeof`` name; ``value`` a Python list.

    NA entries are ``None`` (integer, logical, character) or NaN (double).  ``tags`` is only set
    for pairlists (the element names).  ``attributes`` maps attribute name -> decoded value.
    """

    kind: str
    value: list
    attributes: dict[str, Any] = field(default_factory=dict)
    tags: list[str | None] | None = None

    @property
    def names(self) -> list[str | None] | None:
        """``names(x)``: the names attribute, or a pairlist's tags."""
        names = self.attributes.get("names")
        if isinstance(names, RObject):
            return names.value
        return self.tags

    def as_dict(self) -> dict[str, Any]:
        """A named list or pairlist as ``{name: element}`` (every element must be named)."""
        names = self.names
        if names is None or any(n is None for n in names):
            raise RDataError(f"this R {self.kind} has unnamed elements; it cannot become a dict")
        return dict(zip(names, self.value))


@dataclass(frozen=True)
class RSymbol:
    name: str


@dataclass
class REnvironment:
    """An environment: its frame as a dict; ``special`` names baseenv/globalenv/... singletons."""

    frame: dict[str, Any] = field(default_factory=dict)
    special: str | None = None


@dataclass(frozen=True)
class RPersistent:
    """A reference a lazy-load database stored elsewhere (PERSISTSXP); ``key`` is its name."""

    key: tuple[str | None, ...]


class _Reader:
    """Sequential XDR reader over one serialization stream (``ReadItem`` in serialize.c)."""

    def __init__(self, data: bytes) -> None:
        self.buf = memoryview(data)
        self.pos = 0
        self.refs: list[Any] = []
        self.native_encoding = "utf-8"

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise RDataError(f"R serialization truncated at byte {self.pos} (wanted {n} more)")
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints (upper, lower)
            hi, lo = struct.unpack(">II", self.take(8))
            n = (hi << 32) | lo
        return n

    def header(self) -> None:
        magic = self.take(2)
        if magic != b"X\n":
            raise RDataError(f"not an XDR R serialization (starts with {magic!r}; only 'X\\n' is supported)")
        version = self.int()
        self.int(), self.int()  # writer version, minimal reader version
        if version == 3:
            self.native_encoding = self.take(self.int()).decode("ascii").lower()
        elif version != 2:
            raise RDataError(f"R serialization format version {version} is unsupported (need 2 or 3)")

    def item(self) -> Any:
        flags = self.int()
        sxp = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if sxp == NILVALUE_SXP:
            return None
        if sxp in _SINGLETONS:
            return REnvironment(special=_SINGLETONS[sxp])
        if sxp == REFSXP:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if sxp == SYMSXP:
            sym = RSymbol(self.item() or "")
            self.refs.append(sym)
            return sym
        if sxp in (PERSISTSXP, PACKAGESXP, NAMESPACESXP):
            names = self.string_vec()
            if sxp == PERSISTSXP:
                obj: Any = RPersistent(tuple(names))
            else:
                prefix = "package:" if sxp == PACKAGESXP else "namespace:"
                obj = REnvironment(special=prefix + " ".join(str(n) for n in names))
            self.refs.append(obj)
            return obj
        if sxp == ENVSXP:
            return self.environment()
        if sxp in (LISTSXP, LANGSXP, DOTSXP, ATTRLISTSXP, ATTRLANGSXP):
            return self.pairlist(sxp, has_attr, has_tag)
        if sxp == CHARSXP:
            return self.charsxp(flags >> 12)
        if sxp == ALTREP_SXP:
            return self.altrep()
        if sxp in _VECTOR_KINDS:
            obj = RObject(_VECTOR_KINDS[sxp], self.vector(sxp))
            if has_attr:
                obj.attributes = self.attributes()
            return obj
        raise RDataError(f"R object type {sxp} at byte {self.pos - 4} is not supported by this reader")

    def string_vec(self) -> list[str | None]:
        if self.int() != 0:
            raise RDataError("names in persistent strings are not implemented in R either")
        return [self.item() for _ in range(self.int())]

    def charsxp(self, levels: int) -> str | None:
        n = self.int()
        if n == -1:
            return None  # NA_character_
        raw = self.take(n)
        if levels & _UTF8:
            return raw.decode("utf-8", errors="surrogateescape")
        if levels & (_LATIN1 | _BYTES):
            return raw.decode("latin-1")
        try:
            return raw.decode(self.native_encoding)
        except (UnicodeDecodeError, LookupError):
            return raw.decode("latin-1")

    def vector(self, sxp: int) -> list:
        n = self.length()
        if sxp in (STRSXP, VECSXP, EXPRSXP):
            return [self.item() for _ in range(n)]
        if sxp in (INTSXP, LGLSXP):
            ints = struct.unpack(f">{n}i", self.take(4 * n))
            na = [None if v == NA_INTEGER else v for v in ints]
            return na if sxp == INTSXP else [None if v is None else bool(v) for v in na]
        if sxp == REALSXP:
            return list(struct.unpack(f">{n}d", self.take(8 * n)))
        if sxp == CPLXSXP:
            parts = struct.unpack(f">{2 * n}d", self.take(16 * n))
            return [complex(parts[2 * i], parts[2 * i + 1]) for i in range(n)]
        return list(self.take(n))  # RAWSXP

    def attributes(self) -> dict[str, Any]:
        attrs = self.item()
        if not isinstance(attrs, RObject) or attrs.kind != "pairlist":
            raise RDataError("attributes must be a pairlist")
        return {str(tag): value for tag, value in zip(attrs.tags or [], attrs.value)}

    def pairlist(self, sxp: int, has_attr: bool, has_tag: bool) -> RObject:
        """A CONS chain, read iteratively (CAR, then the CDR is the next cell) to avoid deep recursion."""
        kind = "pairlist" if sxp in (LISTSXP, ATTRLISTSXP, DOTSXP) else "language"
        obj = RObject(kind, [], tags=[])
        first = True
        while True:
            attrs = self.attributes() if has_attr else {}
            if first:
                obj.attributes = attrs
            tag = self.item() if has_tag else None
            obj.tags.append(tag.name if isinstance(tag, RSymbol) else tag)
            obj.value.append(self.item())
            first = False
            flags = self.int()
            if flags & 0xFF not in (LISTSXP, LANGSXP, DOTSXP, ATTRLISTSXP, ATTRLANGSXP):
                self.pos -= 4
                tail = self.item()
                if tail is not None:  # an improper list: keep its tail as a last element
                    obj.value.append(tail)
                    obj.tags.append(None)
                return obj
            has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))

    def environment(self) -> REnvironment:
        self.int()  # locked flag
        env = REnvironment()
        self.refs.append(env)  # registered before its contents: they may refer back to it
        self.item()  # enclosing environment
        frame, hashtab, attrs = self.item(), self.item(), self.item()
        if isinstance(frame, RObject):
            env.frame.update(_named(frame))
        if isinstance(hashtab, RObject):
            for bucket in hashtab.value:
                if isinstance(bucket, RObject):
                    env.frame.update(_named(bucket))
        return env

    def altrep(self) -> Any:
        info, state, attrs = self.item(), self.item(), self.item()
        cls = info.value[0].name if isinstance(info, RObject) and isinstance(info.value[0], RSymbol) else "?"
        obj = _expand_altrep(cls, state)
        if isinstance(attrs, RObject) and attrs.kind == "pairlist":
            obj.attributes = {str(t): v for t, v in zip(attrs.tags or [], attrs.value)}
        return obj


def _named(pairlist: RObject) -> dict[str, Any]:
    return {str(t): v for t, v in zip(pairlist.tags or [], pairlist.value) if t is not None}


def _expand_altrep(cls: str, state: Any) -> RObject:
    """The ordinary vector an ALTREP object stands for (R's altclasses.c ``*_Unserialize``)."""
    if cls in ("compact_intseq", "compact_realseq"):
        n, start, step = state.value[:3]
        seq = [start + i * step for i in range(int(n))]
        return RObject("integer", [int(v) for v in seq]) if cls == "compact_intseq" else RObject("double", seq)
    if cls == "deferred_string":  # state = CONS(numeric vector, scalar-int options)
        arg = state.value[0]
        return RObject("character", [_r_as_character(v) for v in arg.value])
    if cls.startswith("wrap_"):  # state = list(x, meta)
        inner = state.value[0]
        return RObject(inner.kind, list(inner.value), dict(inner.attributes))
    raise RDataError(f"ALTREP class {cls!r} is not supported by this reader")


def _r_as_character(v: Any) -> str | None:
    """``as.character`` of one number, as R prints it with 15 significant digits."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, float):
        if math.isinf(v):
            return "Inf" if v > 0 else "-Inf"
        if v == int(v) and abs(v) < 1e15:
            return str(int(v))
        return f"{v:.15g}"
    return str(v)


def unserialize(data: bytes) -> Any:
    """Decode one complete XDR serialization (``unserialize()`` / the body of an RDS file)."""
    reader = _Reader(data)
    reader.header()
    return reader.item()


def read_rds(path: str | Path) -> Any:
    """``readRDS``: an RDS file is the stream above, gzip-, bzip2- or xz-compressed, or plain."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    elif raw[:3] == b"BZh":
        raw = bz2.decompress(raw)
    elif raw[:6] == b"\xfd7zXZ\x00":
        raw = lzma.decompress(raw)
    return unserialize(raw)


def decompress_lazyload(blob: bytes, compressed: int) -> bytes:
    """One ``.rdb`` record: 4-byte big-endian uncompressed length, then the payload.

    ``compressed`` is the index's flag: 1/TRUE = zlib (``R_decompress1``); 2 and 3 add a type
    byte after the length ('0' stored, '1' zlib, '2' bzip2, 'Z' xz; ``R_decompress2/3``).
    """
    if compressed == 0:
        return blob
    expected = struct.unpack(">I", blob[:4])[0]
    if compressed == 1:
        out = zlib.decompress(blob[4:])
    else:
        kind, payload = blob[4:5], blob[5:]
        decoders = {b"0": bytes, b"1": zlib.decompress, b"2": bz2.decompress, b"Z": lzma.decompress}
        if kind not in decoders:
            raise RDataError(f"unknown lazy-load compression type {kind!r}")
        out = decoders[kind](payload)
    if len(out) != expected:
        raise RDataError(f"lazy-load record decompressed to {len(out)} bytes, header says {expected}")
    return out


def read_lazyload_db(base: str | Path) -> dict[str, Any]:
    """Every variable of a lazy-load database ``<base>.rdb`` / ``<base>.rdx`` as ``{name: value}``."""
    base = Path(base)
    index = read_rds(base.with_suffix(".rdx")).as_dict()
    compressed = index.get("compressed")
    level = int(compressed.value[0]) if isinstance(compressed, RObject) else 1
    data = base.with_suffix(".rdb").read_bytes()
    out = {}
    for name, where in index["variables"].as_dict().items():
        offset, length = (int(v) for v in where.value)
        out[name] = unserialize(decompress_lazyload(data[offset:offset + length], level))
    return out
