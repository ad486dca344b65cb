"""Where a decode step's time goes at batch N: schedule, prepare (metadata), the forward pass, sampling, update and
detokenization, timed separately over real steps of the default model (issue 30's "step overhead").

    PYTHONPATH=src .venv/bin/python bench/step_overhead.py --batch 64 --steps 20 --threads 2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

from bytediet import LLM, SamplingParams


def timed(stats, name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            stats[name].append(time.perf_counter() - t0)

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    llm = LLM(args.model, num_threads=args.threads, max_num_seqs=args.batch, max_num_batched_tokens=2048)
    engine = llm.engine
    params = SamplingParams(max_tokens=args.steps + 4, temperature=0.8, seed=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(llm.encode(f"Request {i}: tell me about the weather"), params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill every prompt first
    stats = defaultdict(list)
    runner, sched = engine.runner, engine.scheduler
    sched.schedule = timed(stats, "schedule", sched.schedule)
    sched.update_from_output = timed(stats, "update", sched.update_from_output)
    runner.prepare = timed(stats, "prepare", runner.prepare)
    run = runner.run
    runner.run = timed(stats, "run (incl. prepare)", run)
    engine.sampler.__class__.__call__ = timed(stats, "sample", engine.sampler.__class__.__call__)
    engine._emit = timed(stats, "emit (detok + stop)", engine._emit)
    for _ in range(args.steps):
        timed(stats, "step", engine.step)()
    ms = {k: 1e3 * statistics.median(v) for k, v in stats.items()}
    per_step = {k: (v * args.batch if k.startswith("emit") else v) for k, v in ms.items()}
    forward = per_step["run (incl. prepare)"] - per_step["prepare"]
    result = {
        "batch": args.batch,
        "threads": args.threads,
        "load_average": list(os.getloadavg()),
        "median_ms_per_step": per_step,
        "forward_ms": forward,
        "non_kernel_ms": per_step["step"] - forward,
        "non_kernel_fraction": (per_step["step"] - forward) / per_step["step"],
        "decode_path": runner.decode_path,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in per_step.items():
            print(f"{k:24s} {v:8.2f} ms")
        print(
            f"non-kernel {result['non_kernel_ms']:.2f} ms of {per_step['step']:.2f} "
            f"({100 * result['non_kernel_fraction']:.0f} %), load {result['load_average']}"
        )


if __name__ == "__main__":
    main()
