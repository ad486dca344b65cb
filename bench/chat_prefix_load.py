"""Multi-turn chat whose shared prefixes outgrow the KV pool: ``bytediet serve`` with its KV tiers off and on, and
llama.cpp's ``llama-server`` with its RAM prompt cache (``--cache-ram``), on the same requests (issue 31).

The workload: ``--system-prompts`` long system prompts (Austen passages of about ``--system-tokens`` tokens), and
``--conversations`` conversations cycling over them, each ``--turns`` user turns long. A turn's prompt is the
system prompt, the earlier turns with a fixed assistant reply each (so both servers see the same text) and the new
question; every request asks for ``--max-tokens`` tokens at temperature 0. ``--clients`` conversations run at
once. bytediet's pool has the bytes of ``--pool-fraction`` of the system prompts' tokens in fp32 KV, so without
tiers most prefixes are evicted before their next turn; with ``--kv-offload-size`` they come back from RAM;
``--kv-cache-dtype`` (e.g. bf16, like llama-server's f16 cache) fits more tokens into those bytes. llama-server gets
one slot per client, each large enough for a whole conversation, and its default prompt cache; the report gives
both servers' KV bytes. ``--pool-bytes llama`` gives bytediet's pool llama-server's KV bytes instead (the report
says how many times the prefixes outgrow the pool's tokens in its codec).

Reported per system: TTFT p50 / mean / p99, output tokens/s, wall time, errors; for bytediet the prefix-cache and
tier hit tokens from ``/metrics``; the load average before each run.

    PYTHONPATH=src .venv/bin/python bench/chat_prefix_load.py --model default --json > chat.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_load import one_request, serve_command, wait_healthy

from bytediet.perf.bench import percentile
from bytediet.perf.llama_server import LlamaServer, binary_version, find_binary, free_port, server_command

NOVELS = ("prideprejudice", "emma", "persuasion", "sensesensibility", "mansfieldpark", "northangerabbey")
QUESTIONS = (
    "Who is the first person named in the passage above?",
    "In one sentence, what happens in it?",
    "Which place is mentioned, if any?",
    "Quote its shortest sentence.",
)
REPLY = "I have read the passage carefully and answered as well as I can."
SYSTEMS = ("bytediet", "bytediet+tiers", "llama-server")


def system_prompts(tokenizer, count: int, tokens: int) -> list[str]:
    """``count`` passages of about ``tokens`` tokens, from the novels in turn, each from a different place."""
    from bytediet.eval.corpus import novel_text

    out = []
    for i in range(count):
        text = novel_text(NOVELS[i % len(NOVELS)])
        words = text.split()
        start = (i // len(NOVELS)) * 40_000 + 2_000
        if start + 2 * tokens > len(words):  # a short novel's later prompts: closer together, still apart
            start = 2_000 + (i // len(NOVELS)) * 2 * tokens
        n = tokens * 3 // 4
        while True:
            passage = " ".join(words[start : start + n])
            have = len(tokenizer.encode(passage))
            if have >= tokens or start + n >= len(words):
                break
            n += max(16, (tokens - have) * 3 // 4)
        out.append(f"You answer questions about this passage.\n\n{passage}\n\n")
    return out


def conversation_prompts(prefixes: list[str], conversations: int, turns: int) -> list[list[str]]:
    """conversation → its turns' prompts (conversation c over prefix c mod len(prefixes))."""
    convs = []
    for c in range(conversations):
        history, prompts = prefixes[c % len(prefixes)], []
        for t in range(turns):
            question = QUESTIONS[(c + t) % len(QUESTIONS)]
            prompts.append(f"{history}User: {question}\nAssistant:")
            history += f"User: {question}\nAssistant: {REPLY}\n"
        convs.append(prompts)
    return convs


async def run_conversations(base: str, convs: list[list[str]], clients: int, max_tokens: int) -> tuple[list, float]:
    """Every conversation's turns in order; ``clients`` conversations at once. (results, wall seconds)"""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)
    queue: asyncio.Queue = asyncio.Queue()
    for c in convs:
        queue.put_nowait(c)
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=base, timeout=900, limits=limits) as http:

        async def client() -> None:
            while not queue.empty():
                for turn, prompt in enumerate(queue.get_nowait()):
                    r = await one_request(http, prompt, max_tokens, 0.0)
                    results.append({**r, "turn": turn})

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return results, time.perf_counter() - t0


def summary(results: list[dict], wall: float, load: tuple) -> dict:
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    later = [r["ttft"] for r in ok if r.get("ttft") is not None and r["turn"] > 0]
    first = [r["ttft"] for r in ok if r.get("ttft") is not None and r["turn"] == 0]
    q = lambda xs, p: percentile(xs, p) if xs else None
    return {
        "load_average_before": [round(x, 2) for x in load],
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_errors": [r for r in results if "error" in r][:3],
        "wall_s": wall,
        "ttft_s": {"p50": q(ttft, 50), "mean": statistics.fmean(ttft) if ttft else None, "p99": q(ttft, 99)},
        "ttft_later_turns_p50_s": q(later, 50),
        "ttft_first_turns_deciles_s": [q(first, p) for p in range(10, 100, 10)],
        "ttft_later_turns_deciles_s": [q(later, p) for p in range(10, 100, 10)],
        "output_tokens": sum(r["chunks"] for r in ok),
        "output_tokens_per_s": sum(r["chunks"] for r in ok) / wall,
    }


def kv_bytes_per_token(model: str, codec: str = "fp32") -> float:
    """The model's KV bytes a token in a pool of ``codec`` (``auto``: fp32), every layer counted."""
    from bytediet.kvcache import get_kv_codec
    from bytediet.models.loader import load_config

    c = load_config(model)
    if codec in ("auto", "fp32"):
        return c.num_layers * c.num_kv_heads * c.head_dim * 2 * 4
    return c.num_layers * get_kv_codec(codec).bytes_per_token(c.num_kv_heads, c.head_dim)


def run_bytediet(args, convs, pool_bytes: int, tiers: bool) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    tier_args = ["--kv-offload-size", args.offload_size] if tiers else []
    tier_args += ["--kv-cache-dtype", args.kv_cache_dtype]
    sized = argparse.Namespace(**vars(args), kv_cache_memory=str(pool_bytes))
    cmd = serve_command(sized, port, "--log-level", "warning", *tier_args)
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(base, proc)
        load = os.getloadavg()
        results, wall = asyncio.run(run_conversations(base, convs, args.clients, args.max_tokens))
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    report = summary(results, wall, load)

    def metric(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^bytediet:{name}(?:_total)?\{{[^}}]*\}} (\S+)$", metrics, re.M))

    report.update(
        command=" ".join(["bytediet serve", *cmd[4:]]),
        prefix_cache_query_tokens=metric("prefix_cache_queries"),
        prefix_cache_hit_tokens=metric("prefix_cache_hits"),
        tier_hit_tokens=metric("kv_offload_hit_tokens"),
        tier_skipped_tokens=metric("kv_offload_skipped_tokens"),
        kv_cache_usage_after=metric("kv_cache_usage_perc"),
    )
    return report


def run_llama_server(args, convs, slot_tokens: int) -> dict:
    from bytediet.models.loader import resolve_model_path

    binary, why = find_binary()
    if binary is None:
        raise SystemExit(why)
    port = free_port()
    cmd = server_command(
        binary,
        resolve_model_path(args.model),
        port=port,
        threads=args.threads,
        slots=args.clients,
        ctx_per_slot=slot_tokens,
        prompt_cache=True,
    )
    cmd += ["--cache-ram", str(args.llama_cache_ram_mib)]
    server = LlamaServer(cmd, port)
    try:
        load = os.getloadavg()
        results, wall = asyncio.run(run_conversations(f"http://127.0.0.1:{port}", convs, args.clients, args.max_tokens))
    finally:
        log = server.log_tail(40)
        server.stop()
    report = summary(results, wall, load)
    report.update(command=" ".join(cmd), version=binary_version(binary))
    if report["errors"]:
        report["server_log_tail"] = log
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--system", default="all", choices=[*SYSTEMS, "all"])
    ap.add_argument("--system-prompts", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=2048, help="tokens of each system prompt (about)")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4, help="conversations at once")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pool-fraction", type=float, default=0.25, help="bytediet's pool / the system prompts' tokens")
    ap.add_argument(
        "--pool-bytes",
        default="fraction",
        choices=["fraction", "llama"],
        help="bytediet's KV pool: --pool-fraction of the prefixes in fp32 bytes, or llama-server's KV bytes",
    )
    ap.add_argument("--offload-size", default="4GiB", help="bytediet's --kv-offload-size with tiers on")
    ap.add_argument("--kv-cache-dtype", default="auto", help="bytediet's KV codec (the pool's bytes stay the same)")
    ap.add_argument("--llama-cache-ram-mib", type=int, default=8192, help="llama-server --cache-ram (MiB)")
    ap.add_argument(
        "--serve-arg", action="append", default=[], help="an extra `bytediet serve` argument (repeat; e.g. =--x=1)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.conversations < 1 or args.turns < 1 or args.clients < 1 or not 0 < args.pool_fraction <= 1:
        ap.error("--conversations, --turns and --clients must be ≥ 1, and --pool-fraction in (0, 1]")

    from bytediet.models.loader import resolve_model_path
    from bytediet.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(args.model))
    prefixes = system_prompts(tokenizer, args.system_prompts, args.system_tokens)
    prefix_tokens = [len(tokenizer.encode(p)) for p in prefixes]
    convs = conversation_prompts(prefixes, args.conversations, args.turns)
    longest = max(len(tokenizer.encode(c[-1])) for c in convs) + args.max_tokens
    # the pool must hold one whole request (its served context is capped by what the pool holds)
    pool_tokens = max(int(sum(prefix_tokens) * args.pool_fraction), longest + 64)
    pool_bytes = pool_tokens * kv_bytes_per_token(args.model)
    slot_tokens = 256 * -(-(longest + 16) // 256)  # llama-server: one slot per client, a conversation each
    llama_kv_bytes = args.clients * slot_tokens * kv_bytes_per_token(args.model) // 2  # f16
    if args.pool_bytes == "llama":  # the same KV bytes as llama-server's slots
        pool_bytes = llama_kv_bytes
        pool_tokens = int(pool_bytes // kv_bytes_per_token(args.model))
    codec_tokens = int(pool_bytes // kv_bytes_per_token(args.model, args.kv_cache_dtype))
    result = {
        "model": args.model,
        "workload": {
            "system_prompt_tokens": prefix_tokens,
            "conversations": args.conversations,
            "turns": args.turns,
            "clients": args.clients,
            "max_tokens": args.max_tokens,
            "longest_request_tokens": longest,
            "bytediet_pool_bytes": pool_bytes,
            "bytediet_pool_fp32_tokens": pool_tokens,
            "bytediet_kv_cache_dtype": args.kv_cache_dtype,
            "pool_fraction_of_prefixes": pool_tokens / sum(prefix_tokens),
            "bytediet_pool_tokens_in_its_codec": codec_tokens,
            "prefixes_over_pool_tokens": sum(prefix_tokens) / codec_tokens,
            "llama_server_kv_bytes": llama_kv_bytes,
        },
        "systems": {},
    }
    names = SYSTEMS if args.system == "all" else (args.system,)
    for name in names:
        print(f"[chat-prefix] {name}", file=sys.stderr, flush=True)
        if name == "llama-server":
            result["systems"][name] = run_llama_server(args, convs, slot_tokens)
        else:
            result["systems"][name] = run_bytediet(args, convs, pool_bytes, tiers=name == "bytediet+tiers")
    s = result["systems"]
    if "bytediet+tiers" in s:
        for other in ("bytediet", "llama-server"):
            if other in s and s[other]["ttft_s"]["p50"]:
                result[f"ttft_p50_tiers_over_{other}"] = (
                    s["bytediet+tiers"]["ttft_s"]["p50"] / s[other]["ttft_s"]["p50"]
                )
                result[f"throughput_tiers_over_{other}"] = (
                    s["bytediet+tiers"]["output_tokens_per_s"] / s[other]["output_tokens_per_s"]
                )
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))
    sys.exit(1 if any(r["errors"] for r in s.values()) else 0)


if __name__ == "__main__":
    main()
