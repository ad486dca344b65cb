"""Resumable runs: every completed measurement is a small JSON file in the output directory.

Layout: ``<out>/cache/<key>/<step>/<item>.json`` where ``key`` is a hash of what the numbers depend
on (the checkpoint's path, size and modification time; the evaluation settings; the planning
context). A killed run, started again with the same model and settings, finds its finished items
and measures only the rest; changed settings get a fresh key and never mix with old numbers.
The reference model's logits are kept beside them (``reference/window<i>.f32``, one file per evaluation window,
read one at a time) so a resumed run need not re-run the unmodified model.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

from ..eval.harness import HEADER_BYTES


def model_identity(path: str) -> dict:
    """What identifies a checkpoint on disk: resolved path, and size + mtime of its file(s)."""
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    stats = [(f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in files if f.exists()]
    return {"path": str(p.resolve()), "files": stats}


def run_key(identity: dict, settings: dict) -> str:
    blob = json.dumps({"model": identity, "settings": settings}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _slug(item: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9_.=-]+", "_", item).strip("_")[:80]
    return f"{clean}-{hashlib.sha1(item.encode()).hexdigest()[:8]}"


class StepCache:
    """JSON results per (step, item) under ``<out>/cache/<key>``; writes are atomic (rename)."""

    def __init__(self, out_dir: str | Path, key: str) -> None:
        self.root = Path(out_dir) / "cache" / key
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, step: str, item: str) -> Path:
        return self.root / step / f"{_slug(item)}.json"

    def get(self, step: str, item: str) -> Optional[Any]:
        try:
            return json.loads(self._path(step, item).read_text())["value"]
        except (OSError, ValueError, KeyError):
            return None

    def put(self, step: str, item: str, value: Any) -> None:
        path = self._path(step, item)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"item": item, "value": value}, default=float))
        tmp.replace(path)

    # ---- the reference model's logits (one file per window) and task results
    @property
    def reference_dir(self) -> Path:
        return self.root / "reference"

    @property
    def reference_path(self) -> Path:
        """The reference's task results; written once its windows' logits are all in :attr:`reference_dir`."""
        return self.reference_dir / "results.json"

    def save_reference(self, reference, windows: int) -> None:
        if not reference.has_logits(windows):
            raise ValueError("the reference has not scored every window yet")
        for i in range(windows):  # logits a cache kept in memory go to disk too
            if not reference.window_path(i).is_file():
                logits = reference.logits(i)
                reference._new_file(i, *logits.shape)
                with open(reference.window_path(i), "r+b") as f:
                    f.seek(HEADER_BYTES)
                    f.write(logits.numpy().tobytes())
        tmp = self.reference_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(reference.results, default=float))
        tmp.replace(self.reference_path)

    def load_reference(self, reference, windows: int) -> bool:
        """Fill ``reference`` (a fresh :class:`ReferenceCache` over :attr:`reference_dir`) from disk: the task
        results and where each window's logits are (read one window at a time when compared); False when an
        earlier run did not finish them."""
        try:
            results = json.loads(self.reference_path.read_text())
        except (OSError, ValueError):
            return False
        if not reference.adopt_windows(windows):
            return False
        reference.results.update(results)
        return True
