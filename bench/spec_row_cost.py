"""A draft row's price on the copy tasks alone: SmolLM2 with n-gram speculation over the speculative bench's spelling
and names prompts (2 rounds, 128 tokens), each lone decode step timed whole (the engine's VerifyCosts) and its forward
pass alone, by query rows; prints both medians and the row cost each gives.

    PYTHONPATH=src .venv/bin/python bench/spec_row_cost.py [--model default] [--rounds 2]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from bytediet.engine.llm import LLM
from bytediet.engine.params import SamplingParams
from bytediet.eval.corpus import novel_text
from bytediet.perf.speculative_bench import copy_prompts, prompt_token_ids

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def forward_times(llm) -> dict[int, list[float]]:
    """Wrap the runner: rows → seconds of each lone decode step's forward pass (filled as the engine steps)."""
    runner, times = llm.engine.runner, collections.defaultdict(list)
    run = runner.run

    def timed(out):
        t0 = time.perf_counter()
        logits = run(out)
        only = out.scheduled[0] if len(out.scheduled) == 1 else None
        if only is not None and only.num_tokens == 1 + len(only.drafts):
            times[only.num_tokens].append(time.perf_counter() - t0)
        return logits

    runner.run = timed
    return times


def slope(medians: dict[int, float]) -> float:
    """Seconds one more row adds: the least-squares slope through the one-row time."""
    t1 = medians[1]
    wider = [(r, t) for r, t in medians.items() if r > 1]
    return sum((r - 1) * (t - t1) for r, t in wider) / sum((r - 1) ** 2 for r, _ in wider)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(args.model, num_threads=2, speculative_config=SPEC)
    messages = copy_prompts(novel_text("prideprejudice"), per_task=3)
    fwd = forward_times(llm)
    for _ in range(args.rounds):
        for task in ("spelling", "names"):
            for m in messages[task]:
                ids = prompt_token_ids(llm, m)
                llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True))
    costs = llm.engine.verify_costs
    whole = {r: statistics.median(t) for r, t in costs._times.items()}
    forward = {r: statistics.median(t) for r, t in fwd.items()}
    print("rows  whole step ms  forward ms  steps")
    for r in sorted(forward):
        print(f"{r:4d}  {whole.get(r, float('nan')) * 1e3:13.2f}  {forward[r] * 1e3:10.2f}  {len(fwd[r]):5d}")
    print(
        f"row cost: engine (whole steps) {costs.row_cost():.3f}; forward slope / whole plain step "
        f"{slope(forward) / whole[1]:.3f}; forward slope / forward plain step {slope(forward) / forward[1]:.3f}"
    )


if __name__ == "__main__":
    main()
