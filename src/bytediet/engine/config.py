"""The engine's configuration: which model, how to store it (weights, KV cache), how to schedule it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from ..config import SchedulerConfig, parse_bytes
from ..errors import ConfigError
from ..kvcache.config import CacheConfig
from .speculative import SpeculativeConfig


@dataclass(frozen=True)
class OffloadConfig:
    """KV tiers below the pool (docs/kv-tiers.md): host RAM (``ram_size`` bytes, 0 = none) and a disk directory
    (``dir``, None = none; ``disk_size`` bytes), optionally re-encoded at rest with ``codec`` (a KV codec name)."""

    dir: Optional[str] = None
    ram_size: int = 0
    disk_size: int = 40 << 30
    codec: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("ram_size", "disk_size"):
            object.__setattr__(self, name, parse_bytes(getattr(self, name)))
            if getattr(self, name) < 0:
                raise ConfigError(f"kv offload {name} must not be negative")
        if self.dir is not None:
            object.__setattr__(self, "dir", str(self.dir))

    @property
    def enabled(self) -> bool:
        return bool(self.dir) or self.ram_size > 0


@dataclass(frozen=True)
class EngineConfig:
    """Everything an ``LLM`` needs: which model, how to store it, how to schedule it."""

    model: str = "default"
    dtype: str = "float32"
    weights: Optional[str] = None  # weight format of the linear layers (None: the checkpoint's own)
    weight_overrides: Mapping[str, str] = field(default_factory=dict)  # layer pattern → format (QuantizeConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: Optional[int] = None
    seed: int = 0
    tensor_parallel_size: int = 1  # processes the model is split across (bytediet.distributed)
    speculative: Optional[SpeculativeConfig] = None  # speculative decoding (engine/speculative.py), None: off
    device: str = "cpu"  # where the model, KV pool and sampler live: cpu or cuda (resolved once, engine/device.py)
    gpu_memory_utilization: float = 0.9  # CUDA: the share of the device's memory the engine may fill (vLLM's)
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of replaying CUDA graphs
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # KV tiers below the pool

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight_overrides", dict(self.weight_overrides))
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda once resolved (engine/device.py), got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.scheduler.max_num_batched_tokens < self.cache.block_size:
            raise ConfigError(
                f"--max-num-batched-tokens {self.scheduler.max_num_batched_tokens} is smaller than one "
                f"KV block ({self.cache.block_size} tokens); raise it or lower --block-size"
            )
