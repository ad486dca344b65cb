"""``bytediet bench --parts speculative``: batch-1 decode with and without speculative decoding, beside llama.cpp's
prompt-lookup decoding (llama-cpp-python's ``LlamaPromptLookupDecoding``) in the same run.

Prompts are written from the corpus: three copy-heavy tasks (a passage whose spelling is to be corrected, one to
repeat with the names changed, one to summarise by quoting it) and open-ended chat with nothing to copy. Every
system decodes the same chat-templated token ids greedily for ``max_tokens`` (EOS ignored); decode tok/s counts
the tokens after the first over the time after the first.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from typing import Optional, Sequence

OPEN_PROMPTS = (
    "Tell me a short story about a lighthouse keeper.",
    "What makes a good friend? Answer in a paragraph.",
    "Describe an ideal autumn weekend in the countryside.",
)


def _misspell(passage: str, rng: random.Random) -> str:
    """Every fifth word of four letters or more gets two neighbouring letters swapped."""
    words = passage.split(" ")
    for i in range(2, len(words), 5):
        w = words[i]
        if len(w) >= 4 and w.isalpha():
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


def copy_prompts(text: str, seed: int = 0, words: int = 90) -> dict[str, list[str]]:
    """task → user messages: 'spelling', 'names' and 'quote' over passages of ``text``, and 'open'."""
    rng = random.Random(seed)
    paragraphs = [p.replace("\n", " ").strip() for p in text.split("\n\n")]
    passages = [" ".join(p.split()[:words]) for p in paragraphs if len(p.split()) >= words][:40]
    if len(passages) < 3:
        raise ValueError("the corpus has too few long paragraphs for the copy prompts")
    pick = rng.sample(passages, 3)
    return {
        "spelling": [f"Correct the spelling in this passage and write it out in full:\n\n{_misspell(pick[0], rng)}"],
        "names": [f"Repeat this paragraph word for word, with every name changed to Smith:\n\n{pick[1]}"],
        "quote": [f"Summarise this passage, quoting its most important sentences word for word:\n\n{pick[2]}"],
        "open": list(OPEN_PROMPTS),
    }


def _decode_rate(n_tokens: int, first: float, last: float) -> Optional[float]:
    return (n_tokens - 1) / (last - first) if n_tokens > 1 and last > first else None


def measure_bytediet(llm, prompts: dict[str, list[list[int]]], max_tokens: int) -> dict:
    """task → {"decode_tokens_per_s" (median over its prompts), ...} for one LLM (speculating or not)."""
    from ..engine.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompts["open"][0]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    out = {}
    for task, ids_list in prompts.items():
        before = _spec_counts(llm)
        rates = []
        for ids in ids_list:
            r = llm.generate([ids], params)[0]
            rates.append(_decode_rate(len(r.outputs[0].token_ids), r.first_token_time, r.finish_time))
        after = _spec_counts(llm)
        drafted, accepted, steps = (a - b for a, b in zip(after, before))
        out[task] = {
            "decode_tokens_per_s": statistics.median(x for x in rates if x),
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_tokens_per_verification": 1 + accepted / steps if steps else None,
        }
    return out


def _spec_counts(llm) -> tuple[int, int, int]:
    s = llm.engine.stats
    return s.spec_draft_tokens, s.spec_accepted_tokens, s.spec_verifications


def measure_llama_cpp(
    gguf_path: str, prompts: dict[str, list[list[int]]], max_tokens: int, threads: int, num_pred_tokens: Optional[int]
) -> dict:
    """The same for llama.cpp, with its prompt-lookup decoding (``num_pred_tokens`` drafts) or without (None)."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = None if num_pred_tokens is None else LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens)
    llm = llama_cpp.Llama(
        model_path=gguf_path,
        n_ctx=2048,
        n_threads=threads,
        n_threads_batch=threads,
        draft_model=draft,
        verbose=False,
        seed=0,
    )
    out = {}
    try:
        for task, ids_list in prompts.items():
            rates = []
            for ids in ids_list:
                llm.reset()
                first = last = None
                n = 0
                for _ in llm.generate(list(ids), top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
                    n += 1
                    last = time.perf_counter()
                    first = first or last
                    if n >= max_tokens:
                        break
                rates.append(_decode_rate(n, first, last))
            out[task] = {"decode_tokens_per_s": statistics.median(x for x in rates if x)}
    finally:
        close = getattr(llm, "close", None)
        if close:
            close()
    return out


def run_speculative_bench(
    model: str,
    spec: dict,
    *,
    threads: int,
    max_tokens: int,
    text: str,
    peers: Sequence[str] = ("llama.cpp",),
    progress=lambda msg: None,
) -> dict:
    """bytediet with and without ``spec`` (a speculative config dict) and each available peer, on the same prompts."""
    from ..engine.llm import LLM
    from ..models.loader import resolve_model_path

    result = {
        "machine_load_average": list(os.getloadavg()),
        "threads": threads,
        "max_tokens": max_tokens,
        "speculative_config": spec,
        "systems": {},
        "ratios": {},
    }
    messages = copy_prompts(text)
    llm = LLM(model, num_threads=threads)
    prompts = {
        task: [llm.chat_token_ids([{"role": "user", "content": m}]) for m in ms] for task, ms in messages.items()
    }
    progress("bytediet without speculation")
    result["systems"]["bytediet"] = measure_bytediet(llm, prompts, max_tokens)
    del llm
    progress("bytediet with speculation")
    result["systems"]["bytediet+spec"] = measure_bytediet(
        LLM(model, num_threads=threads, speculative_config=spec), prompts, max_tokens
    )
    if "llama.cpp" in peers:
        path = str(resolve_model_path(model))
        for name, k in (("llama.cpp", None), ("llama.cpp+lookup", spec["num_speculative_tokens"])):
            progress(name)
            try:
                result["systems"][name] = measure_llama_cpp(path, prompts, max_tokens, threads, k)
            except Exception as exc:  # a missing or failing peer is a result, not a crash
                result["systems"][name] = {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
    mine = result["systems"]["bytediet+spec"]
    for other in [n for n in result["systems"] if n != "bytediet+spec"]:
        theirs = result["systems"][other]
        if all(task in theirs for task in mine):
            result["ratios"][other] = {
                task: mine[task]["decode_tokens_per_s"] / theirs[task]["decode_tokens_per_s"] for task in mine
            }
    result["machine_load_average_end"] = list(os.getloadavg())
    return result
