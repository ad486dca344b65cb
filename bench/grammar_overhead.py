"""Per-token cost of constrained decoding: xgrammar vs llguidance on the same tokenizer, schema and tokens.

The chosen library (``bytediet.engine.grammar``) runs once per sampled token of every constrained
sequence: advance the matcher by the sampled token, fill the next-token bitmask, apply it to the
logits row. This script times exactly that loop over the tokens of a valid JSON document (SmolLM2's
tokenizer, 49,152 tokens), plus the one-off costs: tokenizer tables and schema compilation.

    PYTHONPATH=src .venv/bin/python bench/grammar_overhead.py --repeats 5 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bytediet.models.loader import load_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
DOC = {
    "name": "Elizabeth Bennet",
    "age": 20,
    "email": "lizzy@longbourn.example",
    "tags": ["pride", "prejudice", "wit"],
    "address": {"city": "Meryton", "zip": "HT1 2AB"},
}


def summary(setup: float, compile_s: float, per_token: list[tuple[float, float]]) -> dict:
    """One-off costs, and per token the median over repeats after the first (warm-up: caches, torch.compile)."""
    warm = per_token[1:] or per_token
    match = statistics.median(m for m, _ in warm)
    apply = statistics.median(a for _, a in warm)
    return {
        "setup_s": setup,
        "compile_s": compile_s,
        "first_pass_us_per_token": 1e6 * sum(per_token[0]),
        "matcher_us_per_token": 1e6 * match,
        "apply_us_per_token": 1e6 * apply,
        "us_per_token": 1e6 * (match + apply),
    }


def run_xgrammar(tokenizer, vocab: int, ids: list[int], repeats: int) -> dict:
    import xgrammar as xgr

    from bytediet.engine.grammar import GrammarCompiler

    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    per_token = []
    for _ in range(repeats):
        matcher, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab)
        logits = torch.zeros(1, vocab)
        match = apply = 0.0
        for tok in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            t1 = time.perf_counter()
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            t2 = time.perf_counter()
            assert matcher.accept_token(tok), f"xgrammar refused token {tok}"
            match, apply = match + (t1 - t0) + (time.perf_counter() - t2), apply + (t2 - t1)
        per_token.append((match / len(ids), apply / len(ids)))
    return summary(setup, compile_s, per_token)


def run_llguidance(tokenizer, vocab: int, ids: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lltorch
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=sorted(tokenizer.eos_token_ids))
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    per_token = []
    for _ in range(repeats):
        matcher, bitmask = llguidance.LLMatcher(lltok, grammar), lltorch.allocate_token_bitmask(1, vocab)
        logits = torch.zeros(1, vocab)
        match = apply = 0.0
        for tok in ids:
            t0 = time.perf_counter()
            lltorch.fill_next_token_bitmask(matcher, bitmask)
            t1 = time.perf_counter()
            lltorch.apply_token_bitmask_inplace(logits, bitmask)
            t2 = time.perf_counter()
            assert matcher.consume_token(tok), f"llguidance refused token {tok}: {matcher.get_error()}"
            match, apply = match + (t1 - t0) + (time.perf_counter() - t2), apply + (t2 - t1)
        per_token.append((match / len(ids), apply / len(ids)))
    return summary(setup, compile_s, per_token)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    model, tokenizer = load_model(args.model)
    vocab = model.config.vocab_size
    # each library's compact JSON: xgrammar writes ", " and ": ", llguidance "," and ":"
    docs = {"xgrammar": json.dumps(DOC, separators=(", ", ": ")), "llguidance": json.dumps(DOC, separators=(",", ":"))}
    results = {"model": args.model, "vocab_size": vocab, "threads": torch.get_num_threads()}
    for name, fn in (("xgrammar", run_xgrammar), ("llguidance", run_llguidance)):
        ids = tokenizer.encode(docs[name], add_special_tokens=False)
        try:
            results[name] = {"tokens": len(ids), **fn(tokenizer, vocab, ids, args.repeats)}
        except ImportError as exc:
            results[name] = {"error": f"not installed: {exc}"}
    if args.json:
        print(json.dumps(results))
        return
    for name in ("xgrammar", "llguidance"):
        r = results[name]
        print(
            f"{name:11s} "
            + (
                r["error"]
                if "error" in r
                else f"{r['us_per_token']:8.1f} us/token (matcher {r['matcher_us_per_token']:.1f}, mask "
                f"{r['apply_us_per_token']:.1f}; first pass {r['first_pass_us_per_token']:.0f})  "
                f"compile {1e3 * r['compile_s']:.1f} ms  "
                f"tokenizer tables {r['setup_s']:.2f} s"
            )
        )


if __name__ == "__main__":
    main()
