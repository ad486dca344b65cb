"""``bytediet bench --parts speculative``: batch-1 decode with and without speculative decoding, beside llama.cpp
with and without its own n-gram lookup decoding, in the same run.

Prompts are written from the corpus: three copy-heavy tasks (passages whose spelling is to be corrected, to repeat
with the names changed, to summarise by quoting them) and open-ended chat with nothing to copy. Every system decodes
the same chat-templated token ids (a base model without a template: the plain text) greedily for ``max_tokens``
(EOS ignored); decode tok/s counts the tokens after the first over the time after the first. The systems are
interleaved prompt by prompt (each round in a rotated order), so a change in the machine's load falls on all of
them alike; a task's figure is the median over its prompts and rounds.

``prompt_lookup`` says what the text allows: each task's plain greedy output replayed offline with prompt lookup —
the ``ceiling`` with free draft rows, and the speedup ``predicted`` at the engine's measured cost of a draft row with
its adaptive draft length (:func:`replay_lookup`); a task whose output does not copy its prompt has a ceiling near 1.

llama.cpp runs as ``llama-server`` (``bench/build_llama_server.sh``) with ``--spec-type ngram-simple`` (its prompt
lookup: the last n-gram looked up earlier in the context, the m tokens after it drafted) and, where that binary is
missing, as ``llama-cpp-python`` with ``LlamaPromptLookupDecoding``.
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


def copy_prompts(text: str, seed: int = 0, words: int = 90, per_task: int = 3) -> dict[str, list[str]]:
    """task → user messages: ``per_task`` each of 'spelling', 'names' and 'quote' over distinct passages of ``text``,
    and the 'open' prompts."""
    rng = random.Random(seed)
    paragraphs = [p.replace("\n", " ").strip() for p in text.split("\n\n")]
    passages = [" ".join(p.split()[:words]) for p in paragraphs if len(p.split()) >= words][:60]
    if len(passages) < 3 * per_task:
        raise ValueError(f"the corpus has too few long paragraphs for {per_task} copy prompts a task")
    pick = rng.sample(passages, 3 * per_task)
    spelling, names, quote = pick[:per_task], pick[per_task : 2 * per_task], pick[2 * per_task :]
    return {
        "spelling": [
            f"Correct the spelling in this passage and write it out in full:\n\n{_misspell(p, rng)}" for p in spelling
        ],
        "names": [f"Repeat this paragraph word for word, with every name changed to Smith:\n\n{p}" for p in names],
        "quote": [f"Summarise this passage, quoting its most important sentences word for word:\n\n{p}" for p in quote],
        "open": list(OPEN_PROMPTS[:per_task]),
    }


PROMPT_FORMATS = {True: "chat template", False: "plain text (the checkpoint has no chat template)"}


def prompt_token_ids(llm, message: str) -> list[int]:
    """One user message in the model's chat template, or as plain text where the checkpoint has none (a base
    model, e.g. Gemma-3-270M's GGUF)."""
    if llm.tokenizer.chat_template:
        return llm.chat_token_ids([{"role": "user", "content": message}])
    return llm.encode(message)


def _decode_rate(n_tokens: int, first: float, last: float) -> Optional[float]:
    return (n_tokens - 1) / (last - first) if n_tokens > 1 and last > first else None


class BytedietDecoder:
    """One bytediet ``LLM`` (speculating or not) decoding one prompt at a time."""

    def __init__(self, name: str, llm) -> None:
        self.name, self.llm = name, llm
        self.speculating = getattr(llm.engine, "speculative", None) is not None
        self.outputs: dict[tuple, list[int]] = {}

    def info(self) -> dict:
        return {"system": "bytediet", "speculating": self.speculating}

    def decode(self, ids: list[int], max_tokens: int) -> tuple[Optional[float], tuple[int, int, int]]:
        """(decode tok/s, (drafted, accepted, verifications) during this prompt); the greedy output is kept in
        ``outputs`` (prompt → token ids)."""
        from ..engine.params import SamplingParams

        before = _spec_counts(self.llm)
        r = self.llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0]
        after = _spec_counts(self.llm)
        self.outputs[tuple(ids)] = list(r.outputs[0].token_ids)
        rate = _decode_rate(len(r.outputs[0].token_ids), r.first_token_time, r.finish_time)
        return rate, tuple(a - b for a, b in zip(after, before))

    def close(self) -> None:
        self.llm = None


def _spec_counts(llm) -> tuple[int, int, int]:
    s = llm.engine.stats
    return s.spec_draft_tokens, s.spec_accepted_tokens, s.spec_verifications


class LlamaServerDecoder:
    """llama.cpp's ``llama-server`` with one slot, with its n-gram lookup decoding (``--spec-type ngram-simple``,
    lookup n-gram ``lookup_n``, ``draft`` tokens drafted) or without (``draft=None``)."""

    def __init__(self, name: str, gguf: str, threads: int, draft: Optional[int], lookup_n: int = 3) -> None:
        from .llama_server import LlamaServer, binary_version, find_binary, free_port, server_command

        binary, why = find_binary()
        if binary is None:
            raise RuntimeError(why)
        port = free_port()
        cmd = server_command(binary, gguf, port=port, threads=threads, slots=1, ctx_per_slot=2048)
        if draft is not None:
            cmd += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(lookup_n)]
            cmd += ["--spec-ngram-simple-size-m", str(draft), "--spec-draft-n-max", str(draft)]
        self.name, self.version, self.server = name, binary_version(binary), LlamaServer(cmd, port)

    def info(self) -> dict:
        return {"system": "llama-server", "version": self.version, "command": " ".join(self.server.command)}

    def decode(self, ids: list[int], max_tokens: int) -> tuple[Optional[float], None]:
        from .llama_server import completion_body, stream_completion

        t0 = time.perf_counter()
        timing = stream_completion(self.server.port, completion_body(ids, max_tokens), t0)
        return _decode_rate(timing.output_tokens, t0 + timing.ttft_s, t0 + timing.finish_s), None

    def close(self) -> None:
        self.server.stop()


class LlamaCppPythonDecoder:
    """llama-cpp-python in process, with its prompt-lookup decoding (``draft`` tokens) or without (None)."""

    def __init__(self, name: str, gguf: str, threads: int, draft: Optional[int]) -> None:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.name = name
        self.llm = llama_cpp.Llama(
            model_path=gguf,
            n_ctx=2048,
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=None if draft is None else LlamaPromptLookupDecoding(num_pred_tokens=draft),
            verbose=False,
            seed=0,
        )

    def info(self) -> dict:
        return {"system": "llama-cpp-python"}

    def decode(self, ids: list[int], max_tokens: int) -> tuple[Optional[float], None]:
        self.llm.reset()
        first = last = None
        n = 0
        for _ in self.llm.generate(list(ids), top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            n += 1
            last = time.perf_counter()
            first = first or last
            if n >= max_tokens:
                break
        return _decode_rate(n, first, last), None

    def close(self) -> None:
        close = getattr(self.llm, "close", None)
        if close:
            close()


def llama_cpp_decoders(gguf: str, threads: int, draft: int) -> list:
    """llama.cpp without and with lookup decoding: llama-server where it is built, else llama-cpp-python."""
    from .llama_server import find_binary

    if find_binary()[0] is not None:
        return [
            LlamaServerDecoder("llama.cpp", gguf, threads, None),
            LlamaServerDecoder("llama.cpp+lookup", gguf, threads, draft),
        ]
    return [
        LlamaCppPythonDecoder("llama.cpp", gguf, threads, None),
        LlamaCppPythonDecoder("llama.cpp+lookup", gguf, threads, draft),
    ]


def measure_interleaved(
    systems: Sequence, prompts: dict[str, list[list[int]]], max_tokens: int, rounds: int, progress=lambda msg: None
) -> dict[str, dict]:
    """system → task → {"decode_tokens_per_s" (median over prompts × rounds), "runs", ...}: every prompt decoded by
    every system in turn, the order rotated each round."""
    rates = {s.name: {task: [] for task in prompts} for s in systems}
    counts = {s.name: {task: [0, 0, 0] for task in prompts} for s in systems}
    for s in systems:  # warm-up
        s.decode(prompts["open"][0], 4)
    for r in range(rounds):
        order = list(systems[r % len(systems) :]) + list(systems[: r % len(systems)])
        progress(f"round {r + 1}/{rounds}: {', '.join(s.name for s in order)}")
        for task, ids_list in prompts.items():
            for ids in ids_list:
                for s in order:
                    rate, spec = s.decode(ids, max_tokens)
                    if rate:
                        rates[s.name][task].append(rate)
                    if spec:
                        counts[s.name][task] = [a + b for a, b in zip(counts[s.name][task], spec)]
    out: dict[str, dict] = {}
    for s in systems:
        out[s.name] = {}
        for task in prompts:
            xs = rates[s.name][task]
            drafted, accepted, steps = counts[s.name][task]
            row = {
                "decode_tokens_per_s": statistics.median(xs) if xs else None,
                "runs": len(xs),
                "min": min(xs, default=None),
                "max": max(xs, default=None),
            }
            if steps:
                row["acceptance_rate"] = accepted / drafted if drafted else None
                row["mean_tokens_per_verification"] = 1 + accepted / steps
            out[s.name][task] = row
    return out


def replay_lookup(prompt: Sequence[int], output: Sequence[int], spec: dict, row_cost: Optional[float] = None) -> float:
    """Speedup over plain decoding that prompt lookup (``spec``'s n-gram sizes and k) reaches on this greedy
    ``output``, replayed offline (greedy verification keeps a draft while it equals the output): every step drafting
    k tokens with free draft rows (``row_cost`` None: the ceiling of the text itself), or the engine's adaptive
    length (:class:`~bytediet.engine.speculative.AdaptiveDraft`) at that cost of a draft row — tokens out over the
    steps' cost, a plain step costing 1."""
    from ..engine.speculative import AdaptiveDraft, NgramProposer

    proposer = NgramProposer(spec.get("prompt_lookup_min", 2), spec.get("prompt_lookup_max", 4))
    k = spec["num_speculative_tokens"]
    draft = AdaptiveDraft(k)
    tokens, done, cost = list(prompt), 0, 0.0
    while done < len(output):
        want = k if row_cost is None else draft.length(row_cost)
        drafts = proposer.propose(tokens + list(output[:done]), want) if want else []
        kept = 0
        while kept < len(drafts) and done + kept < len(output) and drafts[kept] == output[done + kept]:
            kept += 1
        draft.update(len(drafts), kept)
        cost += 1 + (row_cost or 0.0) * len(drafts)
        done += kept + 1
    return len(output) / cost


def lookup_ceilings(prompts: dict, outputs: dict, spec: dict, row_cost: Optional[float]) -> dict:
    """task → {"ceiling": median speedup with free draft rows, "predicted": at ``row_cost`` with the adaptive
    length} over the task's prompts, from the plain greedy ``outputs`` (prompt tuple → token ids)."""
    out = {}
    for task, ids_list in prompts.items():
        done = [(ids, outputs[tuple(ids)]) for ids in ids_list if tuple(ids) in outputs]
        if not done:
            continue
        row = {"ceiling": statistics.median(replay_lookup(p, o, spec) for p, o in done)}
        if row_cost is not None:
            row["predicted"] = statistics.median(replay_lookup(p, o, spec, row_cost) for p, o in done)
            row["row_cost"] = row_cost
        out[task] = row
    return out


def run_speculative_bench(
    model: str,
    spec: dict,
    *,
    threads: int,
    max_tokens: int,
    text: str,
    peers: Sequence[str] = ("llama.cpp",),
    rounds: int = 3,
    per_task: int = 3,
    progress=lambda msg: None,
) -> dict:
    """bytediet with and without ``spec`` (a speculative config dict) and each available peer, on the same prompts,
    interleaved prompt by prompt."""
    from ..engine.llm import LLM
    from ..models.loader import resolve_model_path

    result = {
        "machine_load_average": list(os.getloadavg()),
        "threads": threads,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "speculative_config": spec,
        "systems": {},
        "ratios": {},
        "info": {},
    }
    messages = copy_prompts(text, per_task=per_task)
    base = LLM(model, num_threads=threads)
    result["prompt_format"] = PROMPT_FORMATS[bool(base.tokenizer.chat_template)]
    prompts = {task: [prompt_token_ids(base, m) for m in ms] for task, ms in messages.items()}
    result["prompt_tokens"] = {task: [len(ids) for ids in ids_list] for task, ids_list in prompts.items()}
    systems = [
        BytedietDecoder("bytediet", base),
        BytedietDecoder("bytediet+spec", LLM(model, num_threads=threads, speculative_config=spec)),
    ]
    if "llama.cpp" in peers:
        try:
            systems += llama_cpp_decoders(str(resolve_model_path(model)), threads, spec["num_speculative_tokens"])
        except Exception as exc:  # a missing or failing peer is a result, not a crash
            result["systems"]["llama.cpp"] = {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
    try:
        result["info"] = {s.name: s.info() for s in systems}
        result["systems"].update(measure_interleaved(systems, prompts, max_tokens, rounds, progress))
        if spec.get("method", "ngram") == "ngram":  # what the text allows, and the cost model's forecast
            result["prompt_lookup"] = lookup_ceilings(
                prompts, systems[0].outputs, spec, systems[1].llm.engine.verify_costs.row_cost()
            )
    finally:
        for s in systems:
            s.close()
    mine = result["systems"]["bytediet+spec"]
    for other in [n for n in result["systems"] if n != "bytediet+spec"]:
        theirs = result["systems"][other]
        if all(task in theirs for task in mine):
            div = lambda a, b: a / b if a is not None and b else None
            result["ratios"][other] = {
                task: div(mine[task]["decode_tokens_per_s"], theirs[task]["decode_tokens_per_s"]) for task in mine
            }
    result["machine_load_average_end"] = list(os.getloadavg())
    return result
