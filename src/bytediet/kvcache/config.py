"""The paged KV cache's configuration: it names a codec, so it lives with the codec registry that checks the name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..config import parse_bytes
from ..errors import ConfigError
from .base import default_block_size


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size in tokens, memory budget, codec name, prefix caching.

    ``block_size`` None picks 16 tokens, or the codec's minimum block if that is larger (KIVI's key groups).
    """

    block_size: Optional[int] = None
    kv_cache_memory: int = 1 << 30
    kv_cache_dtype: Any = "auto"  # a codec spec ("auto" = the model's compute dtype) or a calibrated KVCodec
    enable_prefix_caching: bool = True
    num_blocks: Optional[int] = None  # overrides the memory budget (tests)

    def __post_init__(self) -> None:
        if self.block_size is None:
            object.__setattr__(self, "block_size", default_block_size(self.kv_cache_dtype))
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
        if self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory must be positive")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError("num_blocks must be at least 1")
