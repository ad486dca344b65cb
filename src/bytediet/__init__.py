"""bytediet: an LLM inference engine that makes data smaller, fewer and less moved.

    from bytediet import LLM, SamplingParams

    llm = LLM("default")
    print(llm.generate("The memory wall is", SamplingParams(max_tokens=32))[0].outputs[0].text)

The public names are loaded on first use, so ``import bytediet.errors`` (or any low layer) does not pull
in the engine and its dependencies.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# libgomp's threads spin after each parallel torch op (300 000 iterations by default), slowing a native product
# started meanwhile on the shared cores (bench/RESULTS.md, Recording 9); a short spin keeps back-to-back torch ops
# fast. Set before torch loads libgomp; a user's own setting wins.
OMP_SPINCOUNT = "10000"
if "torch" not in sys.modules:
    os.environ.setdefault("GOMP_SPINCOUNT", OMP_SPINCOUNT)

# Some VMs advertise AMX and fault on its first tile load, where PyTorch's bf16 matmul and attention take oneDNN's
# AMX kernels: where this boot's probe saw the tiles fault, oneDNN is capped below AMX (kernels/cpu/amx_probe.py).
try:
    from .kernels.cpu.amx_probe import guard_onednn

    AMX_GUARD = guard_onednn()
except Exception as e:  # the probe must never stop bytediet from loading
    AMX_GUARD = f"AMX probe failed ({e}); oneDNN left as it is"
if AMX_GUARD:
    import warnings

    warnings.warn(f"bytediet: {AMX_GUARD}", RuntimeWarning, stacklevel=2)

# public name → module that defines it
_PUBLIC = {
    "LLM": "bytediet.engine.llm",
    "RequestOutput": "bytediet.engine.llm",
    "CompletionOutput": "bytediet.engine.llm",
    "SamplingParams": "bytediet.engine.params",
}
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

if TYPE_CHECKING:
    from .engine.llm import LLM, CompletionOutput, RequestOutput
    from .engine.params import SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'bytediet' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
