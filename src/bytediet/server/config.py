"""The server's own settings (limits, keys, CORS, shutdown) and the context length it really serves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError

MiB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    """What ``bytediet serve``'s server flags set; the defaults are what a bare ``build_app`` gets.

    Args:
        api_keys: keys accepted as ``Authorization: Bearer KEY`` on ``/v1`` routes; empty = no auth.
        allowed_origins: origins allowed by CORS (``"*"`` for any); empty = no CORS headers at all.
        max_body_bytes: larger request bodies get 413 before they are parsed.
        max_prompts_per_request: most prompts in one /v1/completions batch.
        max_waiting_sequences: most engine sequences queued but not yet running; beyond it 503 + Retry-After.
        max_model_len: context length served (prompt + output); ``None`` = the model's, capped by the KV cache.
        shutdown_timeout: seconds running requests may take to finish after SIGTERM before they are aborted.
    """

    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = 16 * MiB
    max_prompts_per_request: int = 128
    max_waiting_sequences: int = 1024
    max_model_len: Optional[int] = None
    shutdown_timeout: float = 30.0
    retry_after: int = field(default=5)

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        if any(not k or k != k.strip() for k in self.api_keys):
            raise ConfigError("--api-key: keys must be non-empty and hold no surrounding spaces")
        for name in ("max_body_bytes", "max_prompts_per_request", "max_waiting_sequences", "retry_after"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(
                f"--max-model-len must be at least 2 (one prompt and one new token), got {self.max_model_len}"
            )
        if self.shutdown_timeout < 0:
            raise ConfigError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}")


def served_model_len(info, requested: Optional[int]) -> int:
    """The context length the server promises: checked once, at start, against the model and the KV cache.

    One sequence of the full length must fit in the KV cache (as vLLM checks at start-up). Without
    ``requested`` the model's context is capped at the cache's capacity (the start line says so);
    an explicit ``requested`` larger than either is an error telling the user what to change.
    """
    model_len, capacity = info.max_model_len, info.capacity  # an engine.snapshot.EngineInfo
    if requested is None:
        return min(model_len, capacity)
    if requested > model_len:
        raise ConfigError(
            f"--max-model-len {requested} exceeds the model's context window of {model_len} tokens; "
            f"give at most {model_len}"
        )
    if requested > capacity:
        raise ConfigError(
            f"--max-model-len {requested} does not fit the KV cache, which holds {capacity} tokens; "
            f"raise --kv-cache-memory (about {requested / capacity:.1f}x the current budget) "
            f"or give --max-model-len {capacity} or less"
        )
    return requested
