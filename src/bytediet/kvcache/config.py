"""The paged KV cache's configuration: it names a codec, so it lives with the codec registry that checks the name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..config import parse_bytes
from ..errors import ConfigError
from .base import KVCodec, build_kv_codec, default_block_size


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size in tokens, memory budget, codec name (+ calibration state), prefix caching.

    ``kv_cache_dtype`` is always a codec *name* (``"auto"`` = the model's compute dtype, ``"turboquant3.5"``,
    ``"k=q8_0,v=q4_0"``, a budget ``"auto:4.5"``); ``kv_calibration_state`` is what calibration taught that
    codec, as plain data or the path of a file holding it (:mod:`bytediet.kvcache.state`). The engine builds
    the codec object once from the two (:meth:`build_codec`). ``block_size`` None picks 16 tokens, or the
    codec's minimum block if that is larger (KIVI's key groups, the HF residual window).
    """

    block_size: Optional[int] = None
    kv_cache_memory: int = 1 << 30
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    num_blocks: Optional[int] = None  # overrides the memory budget (tests)
    kv_calibration_state: Any = None  # dict of plain data / tensors, or a file path; None: uncalibrated

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_dtype, KVCodec) or not isinstance(self.kv_cache_dtype, str):
            raise ConfigError(
                "kv_cache_dtype must be a codec name; a calibrated codec travels as its name plus "
                "kv_calibration_state=codec.calibration_state()"
            )
        if self.block_size is None:
            object.__setattr__(self, "block_size", default_block_size(self.kv_cache_dtype))
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
        if self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory must be positive")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError("num_blocks must be at least 1")

    def build_codec(self, model_dtype: torch.dtype = torch.float32, rope=None) -> KVCodec:
        """The codec object, from the name and the calibration state (``rope(layer)``: the model's rotary
        embeddings, for states defined before RoPE)."""
        return build_kv_codec(self.kv_cache_dtype, self.kv_calibration_state, model_dtype, rope)
