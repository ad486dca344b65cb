"""KV tiers below the pool: evicted prefix-cache blocks kept in host RAM and on disk (see docs/kv-tiers.md).

:func:`build_tier_store` is the one place the tiers are made from an :class:`~bytediet.engine.config.OffloadConfig`;
the block manager holds the store and decides, the store moves bytes (:mod:`.store`), :mod:`.pages` reads and writes
a block's pages, :mod:`.disk` keeps files, :mod:`.keys` salts the hash chain.
"""

from __future__ import annotations

from typing import Optional

from ...errors import ConfigError
from .disk import DiskTier
from .keys import model_fingerprint, tier_salt
from .pages import BlockPages, offload_codec
from .store import TIERS, TierLoad, TierStore

__all__ = ["TIERS", "TierLoad", "TierStore", "build_tier_store"]


def build_tier_store(offload, model, runner, cache) -> Optional[TierStore]:
    """The tier store for ``offload`` over the runner's pages, or None when no tier is configured."""
    if not offload.enabled:
        return None
    if not cache.enable_prefix_caching:
        raise ConfigError("KV tiers keep prefix-cache blocks: drop --no-prefix-caching or the --kv-offload-* flags")
    if runner.workers is not None:
        raise ConfigError("KV tiers do not support --tensor-parallel-size > 1 yet; drop the --kv-offload-* flags")
    at_rest = offload_codec(offload.codec, model.dtype)
    pages = BlockPages(runner.caches, cache.block_size, runner.codec.name, at_rest, model.dtype)
    if 0 < offload.ram_size < pages.block_bytes:
        raise ConfigError(
            f"--kv-offload-size {offload.ram_size} B is below one block ({pages.block_bytes} B); "
            "raise it (e.g. 4GiB) or set 0 for no RAM tier"
        )
    salt = tier_salt(
        model_fingerprint(model),
        runner.codec.name,
        runner.codec.calibration_state(),
        cache.block_size,
        pages.layout(),
        at_rest.name if at_rest is not None else None,
    )
    disk = None
    if offload.dir:
        describe = {
            "model": getattr(model, "source_path", None) or "?",
            "kv_codec": runner.codec.name,
            "stored_as": at_rest.name if at_rest is not None else runner.codec.name,
            "block_size": cache.block_size,
            "block_bytes": pages.block_bytes,
        }
        disk = DiskTier(offload.dir, salt, offload.disk_size, pages.block_bytes, describe)
    return TierStore(pages, salt, cache.block_size, offload.ram_size, disk)
