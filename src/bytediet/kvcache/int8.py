"""INT8 KV cache: symmetric per-token, per-head scale (fp16). All-in 8 + 16/D bits per coordinate."""

from __future__ import annotations

from ..errors import ConfigError
from .base import KV_CODECS
from .compressed import CompressedCodec
from .tokenwise import TokenwiseHalf


@KV_CODECS.register("int8")
class Int8Codec(CompressedCodec):
    def __init__(self) -> None:
        super().__init__("int8", TokenwiseHalf(8), TokenwiseHalf(8))

    @classmethod
    def from_spec(cls, rest: str) -> "Int8Codec":
        if rest:
            raise ConfigError(f"int8 takes no parameters, got 'int8{rest}'")
        return cls()
