"""The row-interleaved (x4) kernels at 1-8 q16 activation rows, beside the roofline: a verifying step's products.

    PYTHONPATH=src python bench/x4_rows.py [--model gemma3-270m] [--rows 1,2,3,4,5,6,8] [--repeats 15]

For the model's head and its first layer's weights, every runnable kernel variant: the median ms of one product
y = x Wᵀ with M q16 rows (two int8 planes), next to the roofline's time max(weight bytes / read bandwidth, int8
ops / int8 peak) from this machine's measured ceilings (``bytediet roofline --measure``), and the gap. A batch-1
decode step is the M = 1 column; a step verifying k drafts is M = k + 1. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from bytediet.engine.llm import LLM
from bytediet.kernels import ops
from bytediet.kernels.cpu import build
from bytediet.perf.measure import this_machine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_decode import median_s  # a sibling bench script

LAYER_WEIGHTS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--rows", default="1,2,3,4,5,6,8")
    p.add_argument("--repeats", type=int, default=15, help="products timed per cell for the head (layers: 10×)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true", help="accepted for the bench's uniform flags; always JSON")
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    model = LLM(a.model, num_threads=a.threads).engine.runner.model
    weights = {"head": model.lm_head.weight()}
    for name in LAYER_WEIGHTS:
        weights[name] = model.model.layers[0].get_submodule(name).weight()
    machine = this_machine(threads=a.threads)
    bandwidth, int8_peak = machine.memory_bandwidth, machine.peak_flops["int8"]
    out = {
        "model": a.model,
        "threads": a.threads,
        "read_bandwidth_gbs": bandwidth / 1e9,
        "int8_peak_gops": int8_peak / 1e9,
        "load_average": list(os.getloadavg()),
        "weights": {},
    }
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        nbytes = w.interleaved.numel() * w.interleaved.element_size()
        entry = {"type": int(w.interleaved_type), "shape": [w.out_features, w.in_features], "bytes": nbytes}
        repeats = a.repeats if name == "head" else 10 * a.repeats
        for variant in (v.name for v in build.runnable_variants()):
            cells = {}
            for m in rows:
                x = torch.randn(m, w.in_features, generator=gen)
                ms = 1e3 * median_s(
                    lambda: ops.gemm_x4(w.interleaved_type, w.interleaved, x, None, "q16", variant=variant), repeats
                )
                ops_int8 = 2 * 2 * m * w.out_features * w.in_features  # two planes, a multiply and an add
                predicted = 1e3 * max(nbytes / bandwidth, ops_int8 / int8_peak)
                cells[m] = {"ms": round(ms, 4), "roofline_ms": round(predicted, 4), "gap": round(ms / predicted, 2)}
            entry[variant] = cells
            print(
                f"[x4_rows] {name} {variant}: " + ", ".join(f"{m} rows {c['ms']} ms" for m, c in cells.items()),
                file=sys.stderr,
            )
        out["weights"][name] = entry
    print(json.dumps(out))


if __name__ == "__main__":
    main()
