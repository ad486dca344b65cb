"""This CPU's feature flags and the native kernels' cache folder: read by the build, the dispatcher and the AMX
probe (a module of its own, so ``import bytediet`` can probe AMX without loading the build)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux names them (empty where /proc/cpuinfo is missing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cache_dir() -> Path:
    """Where the compiled kernel libraries are kept (``BYTEDIET_KERNEL_CACHE``, else ``~/.cache/bytediet/kernels``)."""
    root = os.environ.get("BYTEDIET_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "bytediet", "kernels"
    )
    return Path(root)
