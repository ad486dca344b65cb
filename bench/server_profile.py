"""Where the API server and the engine spend CPU under load: ``bytediet serve`` with the engine on a thread or in
its own process, the same streaming load (``server_load.py``'s), CPU seconds per side and, with ``--py-spy``, a
sampled profile of every thread summarised by what it was doing (forward, sampling, detokenization, HTTP, JSON...).

API side = the event loop's thread (engine on a thread) or the whole API process (engine process); engine side =
every other thread or process (the engine loop, the kernel pool, the engine process). Modes alternate
(``--rounds``), so a shared machine's load hits both alike; the load average is recorded before each run.

    PYTHONPATH=src .venv/bin/python bench/server_profile.py --clients 16 --requests 4 --max-tokens 32 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from server_load import measure, serve_command, wait_healthy

from bytediet.perf.llama_server import free_port

MODES = {"thread": "--no-engine-process", "process": "--engine-process"}
# (substring of a frame, category): the innermost matching frame names a sample's category
CATEGORIES = [
    ("_write_to_self", "hand-off to the event loop"),
    ("runner.py", "forward"),
    ("kernels/", "forward"),
    ("models/", "forward"),
    ("sampling.py", "sampling"),
    ("_emit", "detokenize + stop strings"),
    ("scheduler.py", "scheduler"),
    ("block_manager.py", "scheduler"),
    ("engine_counters", "counters"),
    ("connection.py", "pipe"),
    ("pickle", "pipe"),
    ("_deliver", "hand-off to the event loop"),
    ("call_soon_threadsafe", "hand-off to the event loop"),
    ("_drain_commands", "commands"),
    ("take_commands", "commands"),
    ("model_dump_json", "JSON + SSE"),
    ("json", "JSON + SSE"),
    ("server/serving.py", "serving"),
    ("server/completions.py", "serving"),
    ("server/chat.py", "serving"),
    ("metrics.py", "metrics"),
    ("tokenizer", "tokenization"),
    ("pydantic", "pydantic"),
    ("h11", "HTTP"),
    ("uvicorn", "HTTP"),
    ("starlette", "HTTP"),
    ("fastapi", "HTTP"),
    ("selectors.py", "event loop (select)"),
    ("asyncio", "event loop"),
]


def cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def children(pid: int) -> list[int]:
    text = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False).stdout
    return [int(p) for p in text.split()]


def sides(pid: int, mode: str) -> dict[str, float]:
    """CPU seconds of the API side and the engine side of the server ``pid`` now."""
    mine = cpu_seconds(pid)
    engine_procs = [c for c in children(pid) if "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()]
    others = sum(sum(cpu_seconds(c).values()) for c in engine_procs)
    if mode == "thread":
        return {"api": mine.get(pid, 0.0), "engine": sum(mine.values()) - mine.get(pid, 0.0) + others}
    return {"api": sum(mine.values()), "engine": others}


def summarise(raw: Path) -> dict:
    """py-spy raw output → {thread: {category: samples}}."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1] if ": " in frames[0] else frames[0]
        category = next((c for f in reversed(frames) for k, c in CATEGORIES if k in f), "other")
        out[thread][category] += int(n)
    return {t: dict(c.most_common()) for t, c in sorted(out.items(), key=lambda kv: -sum(kv[1].values()))}


def run_mode(args, mode: str, out_dir: Path, round_: int) -> dict:
    port = free_port()
    cmd = serve_command(args, port, MODES[mode], "--log-level", "warning")
    proc = subprocess.Popen(["nice", "-n", str(args.nice), *cmd], stderr=subprocess.DEVNULL)
    spies = []
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        targets = [proc.pid] + (
            [c for c in children(proc.pid) if "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()]
            if mode == "process"
            else []
        )
        if args.py_spy:
            for i, pid in enumerate(targets):
                raw = out_dir / f"{mode}-{round_}-{'api' if i == 0 else 'engine'}.txt"
                spies.append(
                    (
                        raw,
                        subprocess.Popen(
                            [
                                args.py_spy,
                                "record",
                                "--pid",
                                str(pid),
                                "--threads",
                                "--nonblocking",
                                "--format",
                                "raw",
                                "--rate",
                                "100",
                                "-o",
                                str(raw),
                            ],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        ),
                    )
                )
            time.sleep(1.0)
        before = sides(proc.pid, mode)
        report = measure(f"http://127.0.0.1:{port}", args)
        after = sides(proc.pid, mode)
        report["cpu_s"] = {k: round(after[k] - before[k], 2) for k in after}
        usage = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        report["kv_blocks_free_after"] = 'kv_cache_usage_perc{model_name="default"} 0.0' in usage
    finally:
        for _, spy in spies:
            spy.send_signal(2)  # SIGINT: py-spy writes its file
        for _, spy in spies:
            spy.wait(timeout=60)
        proc.terminate()
        proc.wait(timeout=60)
    if spies:
        report["profile"] = {raw.stem: summarise(raw) for raw, _ in spies if raw.exists()}
    report.pop("first_errors", None)
    return {"mode": mode, "round": round_, **report}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--threads", type=int, default=2, help="bytediet serve --threads")
    ap.add_argument("--model", default="default")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--rounds", type=int, default=1, help="thread / process runs, alternating")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--nice", type=int, default=0, help="run the server under nice -n N (a shared machine)")
    ap.add_argument("--py-spy", default=None, metavar="PATH", help="the py-spy binary: also profile every thread")
    ap.add_argument("--out", default="server_profile", help="folder for py-spy's raw profiles")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    args.serve_arg = []
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [run_mode(args, mode, out_dir, r) for r in range(args.rounds) for mode in args.modes]
    if args.json:
        print(json.dumps({"runs": runs}))
        return
    for r in runs:
        print(
            f"{r['mode']:8s} round {r['round']}: {r['output_chunks_per_s']:.1f} tok/s, TTFT p50 "
            f"{r['ttft_s']['p50'] * 1e3:.0f} ms, TPOT p50/p99 {r['tpot_s']['p50'] * 1e3:.0f}/"
            f"{r['tpot_s']['p99'] * 1e3:.0f} ms, errors {r['errors']}, CPU s api {r['cpu_s']['api']} engine "
            f"{r['cpu_s']['engine']}, load {r['load_average_before']}"
        )


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
