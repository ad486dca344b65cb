"""Run ``bytediet bench`` and keep its JSON under bench/results/ (the numbers are discussed in bench/RESULTS.md).

    .venv/bin/python bench/run_bench.py [bytediet bench flags...]

Without ``--out`` the JSON goes to ``bench/results/bench-<date>-<time>[-<weights>].json``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bytediet.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--out" not in args:
        weights = args[args.index("--weights") + 1] if "--weights" in args else None
        name = "bench-" + time.strftime("%Y%m%d-%H%M%S") + (f"-{weights}" if weights else "") + ".json"
        args += ["--out", str(Path(__file__).parent / "results" / name)]
    sys.exit(main(["bench", *args]))
