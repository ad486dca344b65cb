"""A prompt of N new tokens after a cached prefix, on the module path and on the one-call native step: the
measurement behind ``engine.runner.NATIVE_PREFILL_MAX_TOKENS`` (bench/RESULTS.md, Recording 24).

Each request is the cached prefix and N fresh tokens of Austen (never seen before, so only the prefix hits the
cache), greedy, one token out; the paths alternate in two passes after a warm-up pass, median of ``--repeats``.

    PYTHONPATH=src .venv/bin/python bench/native_prefill_limit.py --model gemma3-270m --kv-cache-dtype rot-int8 \\
        --new-tokens 1,2,8,16,32,64,128,256,512 --prefix 2048 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bytediet import LLM, SamplingParams
from bytediet.engine import runner
from bytediet.eval.corpus import load_corpus

PATHS = {"module": 0, "native": 1 << 30}  # NATIVE_PREFILL_MAX_TOKENS for each path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--kv-cache-dtype", default="rot-int8")
    ap.add_argument("--new-tokens", default="1,2,8,16,32,64,128,256,512", help="comma-separated N")
    ap.add_argument("--prefix", type=int, default=2048, help="cached prefix tokens (0: cold prompts)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = [int(n) for n in args.new_tokens.split(",")]
    llm = LLM(args.model, kv_cache_dtype=args.kv_cache_dtype, num_threads=args.threads)
    ids = llm.encode(load_corpus("austen")[:400_000])
    need = args.prefix + 5 * args.repeats * sum(n + 5 for n in sizes)
    if len(ids) < need:
        raise SystemExit(f"the corpus gives {len(ids)} tokens, {need} are needed: ask for fewer or smaller sizes")
    prefix, cursor = ids[: args.prefix], args.prefix
    params = SamplingParams(max_tokens=1, temperature=0)

    def timed(n: int) -> float:
        nonlocal cursor
        prompt = prefix + ids[cursor : cursor + n]
        cursor += n + 5
        t0 = time.perf_counter()
        llm.generate([prompt], params)
        return time.perf_counter() - t0

    ms: dict[str, dict[str, list[float]]] = {str(n): {p: [] for p in PATHS} for n in sizes}
    for pass_, path in enumerate(["module", "module", "native", "module", "native"]):
        runner.NATIVE_PREFILL_MAX_TOKENS = PATHS[path]
        if prefix:
            llm.generate([prefix], params)  # cached (again, if evicted)
        for n in sizes:
            median = statistics.median(timed(n) for _ in range(args.repeats))
            if pass_:  # the first pass warms up
                ms[str(n)][path].append(round(1e3 * median, 1))
    result = {
        "model": args.model,
        "kv_cache_dtype": args.kv_cache_dtype,
        "prefix_tokens": args.prefix,
        "threads": args.threads,
        "load_average_before": list(os.getloadavg()),
        "ms_by_new_tokens": ms,  # per path, one median per pass
    }
    if args.json:
        print(json.dumps(result))
        return
    for n, by_path in ms.items():
        print(f"{n:>5} new tokens: " + "  ".join(f"{p} {v} ms" for p, v in by_path.items()))


if __name__ == "__main__":
    main()
