"""Load test on loopback: C concurrent streaming clients x R requests each, against ``bytediet serve`` and/or
llama.cpp's ``llama-server`` (the side-by-side peer: ``-np C`` slots, continuous batching).

Each server runs as a subprocess on a free loopback port and gets the same load: the same prompts, streaming
``/v1/completions`` with ``max_tokens``, ``temperature`` and ``ignore_eos`` (every request yields exactly
``max_tokens`` tokens). Both keep their default prompt/prefix caching. Reported per server: errors, TTFT and
TPOT (time per output chunk after the first; one chunk per token except for partial characters) p50 / p99
measured at the client, output chunks/s overall. Afterwards bytediet's ``/metrics`` must show every KV
block free; llama-server has no block pool, so its ``/metrics`` (requests processing / deferred) and
``/slots`` (slots still busy) must show it idle. The exit status is 1 when either check fails.

``--sigterm-after S`` (bytediet only) is the graceful-shutdown check under the same load: SIGTERM S seconds in; the
server must exit 0 within ``--shutdown-timeout`` + 2 s with 0 KV blocks in use and no traceback, and every request
must complete, end with an error event, or be refused / unanswered — none may break after its response began.
The issue's acceptance run is ``--clients 64 --requests 10``; llama-server is built by
``bench/build_llama_server.sh``.

    PYTHONPATH=src .venv/bin/python bench/server_load.py --system both --clients 64 --requests 10 \\
        --max-tokens 32 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time

import httpx

from bytediet.perf.bench import percentile
from bytediet.perf.llama_server import LlamaServer, binary_version, find_binary, free_port, server_command

PROMPTS = [
    "It is a truth universally acknowledged",
    "Emma Woodhouse, handsome, clever, and rich,",
    "The family of Dashwood had long been settled in Sussex.",
    "No one who had ever seen Catherine Morland",
]
SYSTEMS = ("bytediet", "llama-server")


async def one_request(c: httpx.AsyncClient, prompt: str, max_tokens: int, temperature: float) -> dict:
    t0 = time.perf_counter()
    first, stamps, error, kind, answered = None, [], None, None, False
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": True, "ignore_eos": True}
    try:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            answered = True
            if r.status_code != 200:
                return {
                    "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}",
                    "kind": "refused",
                    "after_s": time.perf_counter() - t0,
                    "chunks": 0,
                    "status": r.status_code,
                    "t0": t0,
                }
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error, kind = event["error"]["message"], "error_event"
                elif event["choices"] and event["choices"][0]["text"]:
                    now = time.perf_counter()
                    first = first or now
                    stamps.append(now)
            if not done:
                error, kind = (error, kind) if error else ("the stream ended without [DONE]", "broken")
    except httpx.HTTPError as exc:
        # no response at all (nobody listening, or a connection the exiting server never accepted): refused;
        # a connection lost after the response began: broken
        error, kind = repr(exc), "broken" if answered else "unanswered"
    if error:
        return {"error": error, "kind": kind, "after_s": time.perf_counter() - t0, "chunks": len(stamps), "t0": t0}
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return {"ttft": (first - t0) if first else None, "tpot": tpot, "chunks": len(stamps)}


async def run_load(base: str, clients: int, requests: int, max_tokens: int, temperature: float) -> list[dict]:
    # A fresh connection per request: a pooled keep-alive connection that the server closes as it idles out
    # (llama-server: 5 s) races with its reuse and fails a request before it is sent (seen 3 times in 640).
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as c:

        async def client(i: int) -> list[dict]:
            return [
                await one_request(c, PROMPTS[(i + k) % len(PROMPTS)], max_tokens, temperature) for k in range(requests)
            ]

        return [r for rs in await asyncio.gather(*(client(i) for i in range(clients))) for r in rs]


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server at {base} did not become healthy (exit status {proc.poll()})")


def serve_command(args, port: int, *extra: str) -> list[str]:
    """``bytediet serve`` on ``port`` sized for the load (a KV pool of ``--kv-cache-memory``, one slot per client)."""
    return [
        sys.executable,
        "-m",
        "bytediet.cli",
        "serve",
        "--port",
        str(port),
        "--model",
        args.model,
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--max-num-seqs",
        str(args.clients),
        "--threads",
        str(args.threads),
        *getattr(args, "serve_arg", []),
        *extra,
    ]


def run_bytediet(args) -> dict:
    """The load against ``bytediet serve``; afterwards every KV block must be free."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = serve_command(args, port, "--log-level", "warning")
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, env={**os.environ})
    try:
        wait_healthy(base, proc)
        report = measure(base, args)
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    usage = float(re.search(r"bytediet:kv_cache_usage_perc\{[^}]*\} (\S+)", metrics).group(1))
    report.update(command=" ".join(["bytediet serve", *cmd[4:]]), kv_cache_usage_after=usage, idle_after=usage == 0.0)
    spec = re.findall(r"^bytediet:spec_decode_num_(\w+?)(?:_total)?\{[^}]*\} (\S+)$", metrics, re.M)
    if spec:  # served with --speculative-config: drafts verified, proposed and kept
        report["speculative"] = {name: float(value) for name, value in spec}
    return report


def run_bytediet_sigterm(args) -> dict:
    """SIGTERM under load: the clients run as in :func:`run_bytediet`; ``--sigterm-after`` seconds in, the server
    gets SIGTERM. It must exit 0 within ``--shutdown-timeout`` + 2 s, log 0 KV blocks in use, and every request
    must complete, end with an error event (aborted at the deadline), or be refused (503 while draining) or
    unanswered (sent as the server exits: no response at all) — none may break after its response began."""
    import signal
    import tempfile
    import threading

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = serve_command(args, port, "--log-level", "info", "--shutdown-timeout", str(args.shutdown_timeout))
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    wait_healthy(base, proc)
    box: dict = {}
    t0 = time.perf_counter()
    load = threading.Thread(
        target=lambda: box.update(
            results=asyncio.run(run_load(base, args.clients, args.requests, args.max_tokens, args.temperature))
        )
    )
    load.start()
    time.sleep(args.sigterm_after)
    sent = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(timeout=args.shutdown_timeout + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        status = None
    exit_s = time.perf_counter() - sent
    load.join()
    wall = time.perf_counter() - t0
    log.seek(0)
    text = log.read()
    log.close()
    results = box.get("results", [])
    kinds = {
        k: sum(1 for r in results if r.get("kind", "completed") == k)  # every failed request has its kind
        for k in ("completed", "error_event", "refused", "unanswered", "broken")
    }
    unanswered = [r["t0"] - sent for r in results if r.get("kind") == "unanswered"]
    in_use = re.findall(r"KV blocks in use: (\d+) of (\d+)", text)
    report = {
        "clients": args.clients,
        "requests_per_client": args.requests,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "sigterm_after_s": args.sigterm_after,
        "shutdown_timeout_s": args.shutdown_timeout,
        "requests": len(results),
        **kinds,
        "exit_status": status,
        "exit_s_after_sigterm": exit_s,
        "kv_blocks_in_use_at_exit": int(in_use[-1][0]) if in_use else None,
        "wall_s": wall,
        "traceback_in_log": "Traceback" in text,
        "command": " ".join(["bytediet serve", *cmd[4:]]),
        "first_broken": [r for r in results if r.get("kind") == "broken"][:3],
        # when the unanswered requests were sent, relative to SIGTERM (measured: as the drain ended)
        "unanswered_sent_s_after_sigterm": [round(min(unanswered), 2), round(max(unanswered), 2)]
        if unanswered
        else None,
    }
    report["ok"] = (
        status == 0
        and exit_s <= args.shutdown_timeout + 2
        and kinds["broken"] == 0
        and report["kv_blocks_in_use_at_exit"] == 0
        and not report["traceback_in_log"]
    )
    return report


def run_llama_server(args) -> dict:
    """The same load against llama-server with ``-np clients`` slots; afterwards no request or slot may be busy."""
    from bytediet.models.loader import resolve_model_path

    binary, why = find_binary()
    if binary is None:
        raise SystemExit(why)
    longest_prompt = 32  # tokens: every PROMPTS entry is shorter
    ctx = 256 * -(-(longest_prompt + args.max_tokens + 16) // 256)
    port = free_port()
    cmd = server_command(
        binary,
        resolve_model_path(args.model),
        port=port,
        threads=args.threads,
        slots=args.clients,
        ctx_per_slot=ctx,
        prompt_cache=True,
    )
    server = LlamaServer(cmd, port)
    try:
        report = measure(f"http://127.0.0.1:{port}", args)
        metrics = server.get("/metrics")[1]
        slots = json.loads(server.get("/slots")[1])
        if report["errors"]:
            report["server_log_tail"] = server.log_tail(40)
    finally:
        server.stop()
    gauge = {
        k: float(v) for k, v in re.findall(r"^llamacpp:(requests_processing|requests_deferred) (\S+)$", metrics, re.M)
    }
    busy = sum(1 for s in slots if s.get("is_processing"))
    report.update(
        command=" ".join(cmd),
        version=binary_version(binary),
        slots_busy_after=busy,
        **gauge,
        idle_after=busy == 0 and not any(gauge.values()),
    )
    return report


def measure(base: str, args) -> dict:
    # one request first, not counted: both servers are measured warm
    asyncio.run(run_load(base, 1, 1, 4, args.temperature))
    load = os.getloadavg()
    t0 = time.perf_counter()
    results = asyncio.run(run_load(base, args.clients, args.requests, args.max_tokens, args.temperature))
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    q = lambda xs, p: percentile(xs, p) if xs else None
    return {
        "clients": args.clients,
        "requests_per_client": args.requests,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "load_average_before": [round(x, 2) for x in load],
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_errors": [r for r in results if "error" in r][:3],
        "wall_s": wall,
        "ttft_s": {"p50": q(ttft, 50), "p99": q(ttft, 99)},
        "tpot_s": {"p50": q(tpot, 50), "p99": q(tpot, 99)},
        "output_chunks": sum(r["chunks"] for r in ok),
        "output_chunks_per_s": sum(r["chunks"] for r in ok) / wall,
    }


def print_table(reports: dict) -> None:
    ms = lambda v: "—" if v is None else f"{v * 1e3:.0f}"
    rows = [
        ("requests", lambda r: str(r["requests"])),
        ("errors", lambda r: str(r["errors"])),
        ("idle after (KV free / slots idle)", lambda r: str(r["idle_after"])),
        ("TTFT p50 ms", lambda r: ms(r["ttft_s"]["p50"])),
        ("TTFT p99 ms", lambda r: ms(r["ttft_s"]["p99"])),
        ("TPOT p50 ms", lambda r: ms(r["tpot_s"]["p50"])),
        ("TPOT p99 ms", lambda r: ms(r["tpot_s"]["p99"])),
        ("output chunks/s", lambda r: f"{r['output_chunks_per_s']:.1f}"),
        ("wall s", lambda r: f"{r['wall_s']:.1f}"),
        ("load average before", lambda r: " ".join(map(str, r["load_average_before"]))),
    ]
    print(f"{'':36s}" + "".join(f"{name:>16s}" for name in reports))
    for label, cell in rows:
        print(f"{label:36s}" + "".join(f"{cell(r):>16s}" for r in reports.values()))
    for name, r in reports.items():
        print(f"{name}: {r['command']}")
        if r["first_errors"]:
            print(f"{name} first errors: {r['first_errors']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", default="bytediet", choices=[*SYSTEMS, "both"], help="which server(s) get the load")
    ap.add_argument(
        "--clients",
        type=client_levels,
        default=[64],
        help="concurrent clients, or a comma list of levels swept one after another (e.g. 1,4,16,64)",
    )
    ap.add_argument("--requests", type=int, default=10, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--threads", type=int, default=2, help="bytediet serve --threads and llama-server -t / -tb")
    ap.add_argument("--model", default="default")
    ap.add_argument("--kv-cache-memory", default="512MiB", help="bytediet's KV pool")
    ap.add_argument(
        "--sigterm-after",
        type=float,
        default=None,
        metavar="S",
        help="bytediet only: SIGTERM the server S seconds into the load and check the graceful shutdown",
    )
    ap.add_argument("--shutdown-timeout", type=float, default=30.0, help="bytediet serve --shutdown-timeout")
    ap.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for bytediet serve (repeatable), e.g. --serve-arg=--no-engine-process",
    )
    ap.add_argument("--plot", metavar="PNG", help="with several --clients levels: TTFT / TPOT / throughput plots")
    ap.add_argument("--json", action="store_true", help="print one JSON object (system → report, or the sweep)")
    args = ap.parse_args()
    levels = args.clients
    if args.sigterm_after is not None:
        args.clients = levels[0]
        report = run_bytediet_sigterm(args)
        print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
        sys.exit(0 if report["ok"] else 1)
    run = {"bytediet": run_bytediet, "llama-server": run_llama_server}
    names = SYSTEMS if args.system == "both" else (args.system,)
    by_level = {}
    for clients in levels:
        args.clients = clients
        by_level[clients] = {name: run[name](args) for name in names}
        if not args.json:
            print(f"\n{clients} clients × {args.requests} requests")
            print_table(by_level[clients])
    failed = any(r["errors"] or not r["idle_after"] for reports in by_level.values() for r in reports.values())
    if len(levels) == 1:
        if args.json:
            print(json.dumps(by_level[levels[0]]))
    else:
        sweep = sweep_report(by_level)
        if args.plot:
            plot_sweep(sweep, args.plot, f"{args.model}, {args.requests} requests/client, {args.max_tokens} tokens")
            sweep["plot"] = args.plot
        if args.json:
            print(json.dumps(sweep))
        else:
            print(json.dumps(sweep["ratios"], indent=1))
    sys.exit(1 if failed else 0)


def client_levels(text: str) -> list[int]:
    """``64`` or ``1,4,16,64``."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--clients takes integers separated by commas, not {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"--clients needs positive integers, got {text!r}")
    return levels


def sweep_report(by_level: dict[int, dict[str, dict]]) -> dict:
    """Every level's reports and, where both systems ran, bytediet's ratios to llama-server at each level."""
    ratios = {}
    for clients, reports in by_level.items():
        if len(reports) < 2:
            continue
        mine, theirs = reports["bytediet"], reports["llama-server"]
        div = lambda a, b: a / b if a is not None and b else None
        ratios[clients] = {
            "throughput": div(mine["output_chunks_per_s"], theirs["output_chunks_per_s"]),
            "ttft_p50": div(mine["ttft_s"]["p50"], theirs["ttft_s"]["p50"]),
            "tpot_p99": div(mine["tpot_s"]["p99"], theirs["tpot_s"]["p99"]),
        }
    return {"levels": list(by_level), "by_clients": by_level, "ratios": ratios}


def plot_sweep(sweep: dict, path: str, title: str) -> None:
    """TTFT p50/p99, TPOT p50/p99 and throughput against concurrency, one colour per system."""
    from bytediet.perf.plots import plot_concurrency

    series: dict[str, dict[int, dict]] = {}
    for clients, reports in sweep["by_clients"].items():
        for name, r in reports.items():
            series.setdefault(name, {})[int(clients)] = {
                "ttft_p50_s": r["ttft_s"]["p50"],
                "ttft_p99_s": r["ttft_s"]["p99"],
                "tpot_p50_s": r["tpot_s"]["p50"],
                "tpot_p99_s": r["tpot_s"]["p99"],
                "output_tokens_per_s": r["output_chunks_per_s"],
            }
    plot_concurrency(series, path, title)


if __name__ == "__main__":
    main()
