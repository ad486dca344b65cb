"""Tier keys: the prefix-cache hash chain, made stable across processes and salted with what the KV bytes depend on.

The pool's own chain (:func:`bytediet.engine.block_manager.chain_hash`) uses Python's ``hash``: 64 bits, not
collision resistant, and on Python < 3.12 ``hash(None)`` (the chain's root) differs between processes. A block
that outlives the process needs a key that does not: SHA-256 over (parent key, the block's token ids), whose root is
the salt — a digest of the model fingerprint, the KV codec with its calibration state, the block size, the page
layout and the format version — so a cache is never read by another model, codec or layout.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable
from typing import Optional

import torch

FORMAT_VERSION = 1
KEY_BYTES = 16


def chain_key(parent: bytes, tokens: Iterable[int]) -> bytes:
    """The key of a full block: SHA-256 of its parent's key and its token ids, truncated to 128 bits."""
    ids = list(tokens)
    return hashlib.sha256(parent + struct.pack(f"<{len(ids)}q", *ids)).digest()[:KEY_BYTES]


def model_fingerprint(model) -> str:
    """A digest of what the model computes: its class, config, dtype, weight formats, and each tensor's name,
    shape, dtype and first and last 4 KiB (reading every weight byte would cost seconds on a large model)."""
    h = hashlib.sha256()
    h.update(type(model).__name__.encode())
    h.update(repr(getattr(model, "config", None)).encode())
    h.update(str(getattr(model, "dtype", None)).encode())
    formats = getattr(model, "weight_formats", None)
    h.update(repr(formats() if callable(formats) else None).encode())
    for name, t in model.state_dict().items():
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        if t.device.type == "meta" or t.numel() == 0:
            continue
        try:
            flat = t.detach().reshape(-1)
            n = max(1, 4096 // max(flat.element_size(), 1))
            for part in (flat[:n], flat[-n:]):
                h.update(part.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError):  # a tensor type without plain bytes: its name, shape and dtype only
            h.update(b"?")
    return h.hexdigest()


def _state_digest(state) -> str:
    """A digest of a codec's calibration state (tensors by their bytes)."""
    h = hashlib.sha256()

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"T{tuple(x.shape)}{x.dtype}".encode())
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(f"K{k}".encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"L{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            h.update(json.dumps(x, default=str).encode())

    walk(state)
    return h.hexdigest()


def tier_salt(
    model_fp: str, codec_name: str, codec_state, block_size: int, layout: str, stored_as: Optional[str] = None
) -> bytes:
    """The root of every key: changes with the model, the codec (and its calibration), the block size, the page
    layout, the at-rest codec (``--kv-offload-codec``) and the file format."""
    parts = {
        "version": FORMAT_VERSION,
        "model": model_fp,
        "codec": codec_name,
        "codec_state": _state_digest(codec_state),
        "block_size": block_size,
        "layout": layout,
        "stored_as": stored_as,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()
