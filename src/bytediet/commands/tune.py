"""``bytediet tune``: time the native kernels' candidates for a model's shapes on this machine and store the
winners, which every later engine on this machine (same CPU, library build and thread count) reads at start."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import ConfigError
from ._parse import positive_ints


def register(sub) -> None:
    p = sub.add_parser(
        "tune",
        help="autotune the native kernels for a model on this machine",
        description="Times the row-interleaved (x4) against the row-tile kernel for every linear "
        "shape of the model at each batch size, and the thread pool's spin time; "
        "stores the winners under ~/.cache/bytediet/tune (keyed by CPU, kernel build, "
        "bytediet version and threads). Run it on a quiet machine.",
    )
    p.add_argument("--model", default="default", help="GGUF file, bytediet checkpoint, or 'default' / 'gemma3-270m'")
    p.add_argument(
        "--weights", default=None, metavar="FMT", help="weight format to tune for (default: the GGUF's blocks)"
    )
    p.add_argument("--threads", type=int, default=2, help="kernel threads (a tuning holds for this count only)")
    p.add_argument("--batches", default="1,16", help="batch sizes (rows per product) to tune (default 1,16)")
    p.add_argument("--activations", default="q16", choices=["q16", "q8"], help="activation precision to time with")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats per candidate (the best counts)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(handler=run)


def model_shapes(model) -> list[tuple[int, int, int]]:
    """(kernel type, n, k) of every linear layer that a native block kernel multiplies."""
    shapes = []
    for _, lin in model.linear_layers():
        native = lin.native_weight()
        if native is not None:
            shapes.append((int(native[0]), lin.out_features, lin.in_features))
    return list(dict.fromkeys(shapes))


def run(args: argparse.Namespace) -> int:
    import torch

    from ..kernels import ops, tuning
    from ..models.loader import load_model

    if args.threads < 1 or args.repeats < 1:
        raise ConfigError("--threads and --repeats must be at least 1")
    batches = positive_ints(args.batches, "--batches")
    torch.set_num_threads(args.threads)
    lib = ops.native_library()
    if lib is None:
        raise ConfigError("no native kernels on this machine (no compiler, or a CPU without AVX2): nothing to tune")
    lib.set_num_threads(args.threads)
    model, _ = load_model(
        args.model, weights=args.weights, keep_packed=True, load_tokenizer=False, activations=args.activations
    )
    shapes = model_shapes(model)
    say = (lambda msg: None) if args.json else (lambda msg: print(f"[tune] {msg}", file=sys.stderr, flush=True))
    table = tuning.tune(lib, shapes, batches=batches, activations=args.activations, repeats=args.repeats, progress=say)
    path = table.save()
    tuning.forget()
    result = {
        "path": str(path),
        "key": table.key,
        "spin_us": table.spin_us,
        "kernels": table.kernels,
        "measurements": table.measurements,
        "shapes": [list(s) for s in shapes],
        "load_average": list(__import__("os").getloadavg()),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"kernel choice per shape ({args.threads} threads, activations {args.activations}); saved to {path}"
    )
    for col in ("type", "n × k", "batch", "x4 µs", "rows µs", "winner"):
        t.add_column(col, justify="right")
    for m in table.measurements:
        if "batch" in m:
            t.add_row(
                str(m["type"]),
                f"{m['n']} × {m['k']}",
                str(m["batch"]),
                f"{m['x4_s'] * 1e6:.0f}",
                f"{m['rows_s'] * 1e6:.0f}",
                m["winner"],
            )
    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(t)
    console.print(
        f"pool spin: {table.spin_us} µs (load average {result['load_average'][0]:.2f}; tune on a quiet machine)"
    )
    return 0
