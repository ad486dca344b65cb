"""Decode step time at tensor-parallel size 1 vs 2 on this machine, with the time in collectives split out,
next to the roofline's TP prediction (``bytediet roofline --tp``) for the same step.

For each size: one ``LLM`` (size 2 spawns one gloo worker; each rank gets cores / size torch threads, so
both runs use the same cores), ``--batch`` prompts of ``--context`` tokens are prefilled (not timed), then
``--steps`` pure decode steps are timed. On rank 0 every collective is wrapped with a timer: the
all-reduces (two per layer + the embedding's), the logits' all-gather and the step's metadata broadcast.
That time includes waiting for the slower rank (SmolLM2's 3 KV heads split 2 + 1).

The link the roofline needs is measured here too: a ring all-reduce between two gloo processes on
loopback, at the decode step's message size (batch · hidden · 4 bytes) and at 4 MiB. The 4 MiB one gives the
bus bandwidth; the small one, less its bytes over that bandwidth, gives the per-hop latency α (a ring
all-reduce over 2 ranks is 2 hops). The roofline is shown twice: bandwidth only, and with α per hop of each
collective (``HardwareSpec.interconnect_latency``) — the latency is what the small decode messages pay.

    PYTHONPATH=src .venv/bin/python bench/tp_step_time.py [--model default] [--weights fp32] [--batch 4]
        [--context 128] [--steps 16] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _ring_peer(port: int, sizes: list[int], repeats: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=60))
    for n in sizes:
        x = torch.ones(n // 4)
        for _ in range(repeats + 2):
            pg.allreduce([x]).wait()


def measure_allreduce(sizes: list[int], repeats: int = 50) -> dict[int, float]:
    """Median seconds of one gloo all-reduce of ``n`` bytes between two processes, per size."""
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    peer = mp.get_context("spawn").Process(target=_ring_peer, args=(store.port, sizes, repeats), daemon=True)
    peer.start()
    pg = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=60))
    out = {}
    for n in sizes:
        x, times = torch.ones(n // 4), []
        for i in range(repeats + 2):
            t0 = time.perf_counter()
            pg.allreduce([x]).wait()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out[n] = statistics.median(times)
    peer.join(30)
    return out


class CollectiveTimer:
    """Wraps rank 0's collectives (instance attributes shadow the methods) and sums their time."""

    def __init__(self, group) -> None:
        self.seconds, self.calls = 0.0, 0
        for name in ("all_reduce", "all_gather_last", "broadcast_object"):
            setattr(group, name, self._timed(getattr(group, name)))

    def _timed(self, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        return run


def decode_steps(tp: int, args) -> dict:
    from bytediet.engine.llm import LLM
    from bytediet.engine.params import SamplingParams

    threads = args.threads if tp == 1 else None  # size 2: each rank gets cores / 2
    llm = LLM(
        args.model,
        weights=args.weights,
        tensor_parallel_size=tp,
        kv_cache_memory="256MiB",
        num_threads=threads,
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.batch * args.context,
    )
    try:
        timer = CollectiveTimer(llm.workers.group) if llm.workers is not None else None
        engine, vocab = llm.engine, llm.model.config.vocab_size
        g = torch.Generator().manual_seed(0)
        for _ in range(args.batch):
            ids = torch.randint(1, vocab, (args.context,), generator=g).tolist()
            engine.add_request(ids, SamplingParams(max_tokens=args.steps + 8, ignore_eos=True))
        while (
            any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running)
            or engine.scheduler.waiting
        ):
            engine.step()  # prefill (not timed)
        engine.step()
        steps, comm = [], []
        for _ in range(args.steps):
            before = timer.seconds if timer else 0.0
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
            comm.append((timer.seconds if timer else 0.0) - before)
        calls = timer.calls if timer else 0
        return {
            "tp": tp,
            "threads_per_rank": torch.get_num_threads(),
            "step_s": statistics.median(steps),
            "collectives_s": statistics.median(comm),
            "decode_path": engine.runner.decode_path,
            "collective_calls_total": calls,
        }
    finally:
        llm.shutdown()


def roofline(args, link_bandwidth: float, hop_latency: float) -> dict:
    from bytediet.models.loader import load_config
    from bytediet.perf.measure import this_machine
    from bytediet.perf.roofline import analyze
    from bytediet.quant import get_weight_format

    config = load_config(args.model)
    hw = this_machine(measure_if_missing=True, threads=os.cpu_count() or 1)
    # the measured loopback "link": interconnect_bandwidth is both directions, link_bandwidth half of it
    hw = replace(hw, interconnect_bandwidth=2 * link_bandwidth)
    out = {}
    for tp in (1, 2):
        p = analyze(
            config,
            hw,
            weights=get_weight_format(args.weights),
            kv=32.0,
            batch=args.batch,
            context=args.context + 1,
            tp=tp,
        )
        q = analyze(
            config,
            replace(hw, interconnect_latency=hop_latency),
            weights=get_weight_format(args.weights),
            kv=32.0,
            batch=args.batch,
            context=args.context + 1,
            tp=tp,
        )
        out[tp] = {
            "decode_s": p.decode.time,
            "allreduce_s": p.decode.allreduce_s,
            "with_latency": {
                "decode_s": q.decode.time,
                "allreduce_s": q.decode.allreduce_s,
                "allreduce_latency_s": q.decode.allreduce_latency_s,
            },
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--weights", default="fp32")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads at size 1 (default: all cores)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from bytediet.models.loader import load_config
    from bytediet.perf.roofline import ring_link

    hidden = load_config(args.model).hidden_size
    small, big = args.batch * hidden * 4, 4 << 20
    ring = measure_allreduce([small, big])
    bus, hop = ring_link(2, big, ring[big], small, ring[small])  # bus bandwidth, per-hop latency
    runs = [decode_steps(tp, args) for tp in (1, 2)]
    result = {
        "model": args.model,
        "weights": args.weights,
        "batch": args.batch,
        "context": args.context,
        "tp1_threads": args.threads,
        "steps": args.steps,
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "allreduce_small_bytes": small,
        "allreduce_small_s": ring[small],
        "allreduce_4MiB_s": ring[big],
        "bus_bandwidth_Bps": bus,
        "hop_latency_s": hop,
        "runs": runs,
        "roofline": roofline(args, bus, hop),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{args.model} {args.weights}, batch {args.batch}, context {args.context}, {os.cpu_count()} cores, "
        f"load {result['load_average'][0]:.1f}"
    )
    print(
        f"gloo all-reduce: {small} B in {ring[small] * 1e6:.0f} µs; 4 MiB in {ring[big] * 1e3:.2f} ms "
        f"(bus {bus / 1e9:.2f} GB/s, {hop * 1e6:.0f} µs per hop)"
    )
    for r in runs:
        pred = result["roofline"][r["tp"]]
        lat = pred["with_latency"]
        print(
            f"TP={r['tp']}: step {r['step_s'] * 1e3:.1f} ms, in collectives {r['collectives_s'] * 1e3:.1f} ms; "
            f"roofline {pred['decode_s'] * 1e3:.1f} ms of which collectives {pred['allreduce_s'] * 1e3:.3f} ms; "
            f"with the hop latency {lat['decode_s'] * 1e3:.1f} ms of which collectives "
            f"{lat['allreduce_s'] * 1e3:.2f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
