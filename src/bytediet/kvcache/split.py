"""Split specs ``k=<spec>,v=<spec>``: keys and values in different codecs (e.g. k=turboquant_prod3,v=turboquant3).

Any codec built from halves (:class:`CompressedCodec`) or a full-precision codec (fp32/bf16/fp16) can be
either side; the spec's order does not matter, both sides are required.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .compressed import CompressedCodec
from .halves import FullHalf, HalfCodec


def half_of(codec, role: str) -> HalfCodec:
    """The key (``role`` "k") or value ("v") half of a codec; a full-precision codec gives a :class:`FullHalf`."""
    if isinstance(codec, CompressedCodec):
        return codec.key_half if role == "k" else codec.value_half
    dtype = getattr(codec, "storage_dtype", None)
    if isinstance(dtype, torch.dtype):
        return FullHalf(dtype)
    raise ConfigError(f"KV codec {codec.name!r} cannot be used on one side of a k=…,v=… split spec")


def split_codec(spec: str, build) -> CompressedCodec:
    """``build(sub_spec)`` makes a whole codec; its key or value half is taken."""
    sides = {}
    for item in spec.split(","):
        role, sep, sub = item.partition("=")
        role = role.strip()
        if not sep or role not in ("k", "v") or role in sides or not sub.strip():
            raise ConfigError(
                f"bad split KV spec {spec!r}: expected k=<codec>,v=<codec>, e.g. k=turboquant3,v=turboquant4"
            )
        sides[role] = half_of(build(sub.strip()), role)
    if set(sides) != {"k", "v"}:
        raise ConfigError(f"split KV spec {spec!r} must name both k= and v=")
    return CompressedCodec(spec, sides["k"], sides["v"])
