"""Load test of ``bytediet serve`` on loopback: C concurrent streaming clients x R requests each.

Starts the server as a subprocess (the real CLI, on a free loopback port), runs the clients with
httpx, then reads ``/metrics``: every KV block must be free again. Reported: errors, TTFT and TPOT
(time per output token after the first) p50 / p99 measured at the client, tokens/s overall. The issue's
acceptance run is ``--clients 64 --requests 10``; the llama-server side-by-side peer is not written yet.

    PYTHONPATH=src .venv/bin/python bench/server_load.py --clients 64 --requests 10 --max-tokens 64 --json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

import httpx

PROMPTS = ["It is a truth universally acknowledged", "Emma Woodhouse, handsome, clever, and rich,",
           "The family of Dashwood had long been settled in Sussex.", "No one who had ever seen Catherine Morland"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def one_request(c: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first, stamps, error = None, [], None
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "stream": True, "ignore_eos": True}
    try:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                elif event["choices"] and event["choices"][0]["text"]:
                    now = time.perf_counter()
                    first = first or now
                    stamps.append(now)
            if not done:
                error = error or "the stream ended without [DONE]"
    except httpx.HTTPError as exc:
        error = repr(exc)
    if error:
        return {"error": error}
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return {"ttft": (first - t0) if first else None, "tpot": tpot, "chunks": len(stamps)}


async def run_load(base: str, clients: int, requests: int, max_tokens: int) -> list[dict]:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as c:
        async def client(i: int) -> list[dict]:
            return [await one_request(c, PROMPTS[(i + k) % len(PROMPTS)], max_tokens) for k in range(requests)]
        return [r for rs in await asyncio.gather(*(client(i) for i in range(clients))) for r in rs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=10, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default="default")
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "bytediet.cli", "serve", "--port", str(port), "--model", args.model,
                             "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.clients),
                             "--log-level", "warning"], stderr=subprocess.DEVNULL, env={**os.environ})
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        t0 = time.perf_counter()
        results = asyncio.run(run_load(base, args.clients, args.requests, args.max_tokens))
        wall = time.perf_counter() - t0
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    usage = float(re.search(r"bytediet:kv_cache_usage_perc\{[^}]*\} (\S+)", metrics).group(1))
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    report = {"clients": args.clients, "requests_per_client": args.requests, "max_tokens": args.max_tokens,
              "requests": len(results), "errors": len(results) - len(ok),
              "first_errors": [r["error"] for r in results if "error" in r][:3],
              "kv_cache_usage_after": usage, "wall_s": wall,
              "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
              "tpot_s": {"p50": percentile(tpot, 50), "p99": percentile(tpot, 99)},
              "output_chunks_per_s": sum(r["chunks"] for r in ok) / wall,  # one chunk per token, but for partial characters "exit_status": proc.returncode,
              "mean_ttft_s": statistics.fmean(ttft) if ttft else None}
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:22s} {value}")
    if report["errors"] or usage != 0.0:
        sys.exit(1)


if __name__ == "__main__":
    main()
