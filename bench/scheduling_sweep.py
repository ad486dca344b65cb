"""The scheduler's defaults measured: the token budget (``--max-num-batched-tokens``) and the per-request prefill
cap (``--long-prefill-token-threshold``) swept over the bench's long-prompt workload at one concurrency (seeded
Austen prompts of 64–512 tokens, 32–128 output tokens, all arriving at t = 0, no prefix cache, greedy) — TTFT and
TPOT percentiles and throughput per setting, in process, one engine per setting (issue 30: "choose defaults for
this CPU by measurement").

    PYTHONPATH=src .venv/bin/python bench/scheduling_sweep.py --model default --concurrency 64 \\
        --budgets 256,512,1024,2048 --thresholds 0,256 --threads 2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import time

from bytediet import LLM, SamplingParams
from bytediet.eval.corpus import corpus_token_ids
from bytediet.perf.bench import BenchConfig, RequestTiming, make_workload, summarize


def run_setting(llm: LLM, prompts, max_tokens) -> dict:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate([list(p) for p in prompts], params)
    timings = [
        RequestTiming(len(o.prompt_token_ids), len(o.outputs[0].token_ids), o.first_token_time - t0, o.finish_time - t0)
        for o in outs
    ]
    return summarize(timings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--budgets", default="256,512,1024,2048", help="--max-num-batched-tokens values")
    ap.add_argument("--thresholds", default="0", help="--long-prefill-token-threshold values (0: off)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    config = BenchConfig()
    level = args.concurrency
    work, loaded = None, None
    rows = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        for threshold in [int(t) for t in args.thresholds.split(",")]:
            if threshold > budget:
                continue
            llm = LLM(
                args.model,
                loaded=loaded,
                num_threads=args.threads,
                max_num_seqs=level,
                max_num_batched_tokens=budget,
                long_prefill_token_threshold=threshold,
                enable_prefix_caching=False,
            )
            loaded = (llm.model, llm.tokenizer)
            if work is None:  # the bench's own workload at this level
                tokens = config.corpus_tokens(("concurrency",))
                ids, _ = corpus_token_ids(llm.tokenizer, llm.model.config.vocab_size, tokens, config.seed)
                work = make_workload(
                    ids,
                    max(level, config.min_requests),
                    config.prompt_len_range,
                    config.output_len_range,
                    seed=config.seed + level,
                )
            llm.generate([work.prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up
            load = list(os.getloadavg())
            summary = run_setting(llm, work.prompts, work.max_tokens)
            rows.append(
                {
                    "max_num_batched_tokens": budget,
                    "long_prefill_token_threshold": threshold,
                    "load_average_before": load,
                    **summary,
                }
            )
            del llm
            if not args.json:
                r = rows[-1]
                print(
                    f"budget {budget:5d} threshold {threshold:4d}: {r['output_tokens_per_s']:7.1f} tok/s, "
                    f"TTFT p50 {r['ttft_p50_s']:6.2f} s p99 {r['ttft_p99_s']:6.2f} s, "
                    f"TPOT p50 {1e3 * r['tpot_p50_s']:6.1f} ms p99 {1e3 * r['tpot_p99_s']:6.1f} ms",
                    flush=True,
                )
    result = {
        "model": args.model,
        "concurrency": level,
        "threads": args.threads,
        "settings": rows,
        "prompt_tokens": sum(len(p) for p in work.prompts),
    }
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
