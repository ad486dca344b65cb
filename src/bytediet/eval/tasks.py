"""Evaluation tasks, chosen by name from :data:`EVAL_TASKS`: ``ppl`` (fidelity), ``passkey``, ``speed``.

A task measures a :class:`~bytediet.eval.harness.Subject` twice — ``measure_reference`` on the
unmodified model (its result is cached in the :class:`~bytediet.eval.harness.ReferenceCache`) and
``measure_test`` on the configuration under test, which returns the comparison — and lists its
numbers as table rows with ``rows(result)``.  The table and the JSON are both read from the same
result dict, so they cannot disagree.  A new task is one class with ``@EVAL_TASKS.register``.
"""

from __future__ import annotations

import math
import os
import resource
from abc import ABC, abstractmethod
from typing import Any, Iterator, Optional

import numpy as np
import torch

from ..errors import ConfigError
from ..registry import Registry
from . import longctx
from .fidelity import FidelityAccumulator, compare_rows, next_token_pairs, token_nll

EVAL_TASKS: Registry = Registry("eval task")
Row = tuple[str, Any, Any]  # (metric, reference value or None, test value or None)
KL_HIST_EDGES = np.logspace(-8, 2, 41)  # 4 bins per decade; values below 1e-8 are counted apart


def get_eval_task(name: str) -> "EvalTask":
    return EVAL_TASKS.get(name)()


class EvalTask(ABC):
    name: str = "abstract"
    title: str = ""

    @abstractmethod
    def measure_reference(self, subject, ctx) -> dict:
        """Numbers of the unmodified model (JSON-ready)."""

    @abstractmethod
    def measure_test(self, subject, ctx, reference: dict) -> dict:
        """Numbers of the configuration under test, with ``reference`` (from above) and the comparison."""

    @abstractmethod
    def rows(self, result: dict) -> list[Row]:
        """Table rows of a ``measure_test`` result."""


# ----------------------------------------------------------------------------------- fidelity
def _window_pairs(subject, ctx, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (L-1, V) predicting window ``index``'s ids[1:] (L-1,), scored after the BOS prefix if any."""
    ids = ctx.windows[index].ids
    seq = torch.cat([torch.tensor(ctx.bos, dtype=torch.long), ids])
    if subject.llm is not None:  # tensor parallel: every rank runs the forward pass
        logits = subject.llm.score(seq, kv_codec=subject.kv_cache_dtype)  # (B + L, V)
    else:
        logits = subject.model.score(seq, kv_codec=subject.kv_cache_dtype)
    return next_token_pairs(logits[len(ctx.bos) :], ids)


ROW_CHUNK_ELEMENTS = 16 << 20  # logits scored at a time: 64 MiB of float32 (at least 64 rows, a prefill's path)


def _window_chunks(subject, ctx, index: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Window ``index`` scored in chunks of positions: (first position j, logits (n, V) predicting ids[j+1:j+1+n],
    those ids (n,)). One forward pass; only a chunk of logits exists at a time (tensor parallel: all at once)."""
    ids = ctx.windows[index].ids
    if subject.llm is not None:
        logits, targets = _window_pairs(subject, ctx, index)
        yield 0, logits, targets
        return
    b = len(ctx.bos)
    seq = torch.cat([torch.tensor(ctx.bos, dtype=torch.long), ids])
    rows = max(64, ROW_CHUNK_ELEMENTS // subject.model.config.vocab_size)
    for lo, logits in subject.model.score_rows(seq, b, b + len(ids) - 1, rows, kv_codec=subject.kv_cache_dtype):
        j = lo - b
        yield j, logits.cpu(), ids[j + 1 : j + 1 + logits.shape[0]]  # compared on the CPU, where the reference is


def kl_histogram(kl: torch.Tensor) -> dict:
    """Counts of per-position KL over :data:`KL_HIST_EDGES` (log-spaced) plus those below the first edge."""
    values = kl.double().numpy()
    counts, _ = np.histogram(np.clip(values, None, KL_HIST_EDGES[-1]), bins=KL_HIST_EDGES)
    return {"edges": KL_HIST_EDGES.tolist(), "counts": counts.tolist(), "below": int((values < KL_HIST_EDGES[0]).sum())}


@EVAL_TASKS.register("ppl")
class FidelityTask(EvalTask):
    """Perplexity of both models on the corpus windows, KL(ref || test) tail, top-1 agreement, worst windows."""

    name, title = "ppl", "fidelity"

    def measure_reference(self, subject, ctx) -> dict:
        nll, tokens = 0.0, 0
        for i in ctx.progress(range(len(ctx.windows)), "reference windows"):
            total = len(ctx.windows[i].ids) - 1
            for j, logits, targets in _window_chunks(subject, ctx, i):
                ctx.reference.put_rows(i, j, logits, total)
                nll += float(token_nll(logits, targets).sum())
                tokens += len(targets)
                del logits
        return {"ppl": math.exp(nll / tokens), "nll": nll / tokens, "tokens": tokens}

    def measure_test(self, subject, ctx, reference: dict) -> dict:
        acc = FidelityAccumulator(keep_worst=ctx.settings.keep_worst)
        per_window = []
        for i in ctx.progress(range(len(ctx.windows)), "test windows"):
            kl, nll, matches = [], [], 0
            for j, logits, targets in _window_chunks(subject, ctx, i):
                k, n, m = compare_rows(ctx.reference.rows(i, j, j + logits.shape[0]), logits, targets)
                kl.append(k)
                nll.append(n)
                matches += int(m.sum())
                del logits
            nll_both = torch.cat(nll, dim=1)
            w = acc.add_scores(torch.cat(kl), nll_both[0], nll_both[1], matches, name=str(ctx.windows[i].start))
            per_window.append(
                {
                    "start": ctx.windows[i].start,
                    "tokens": w.tokens,
                    "ppl_ref": math.exp(w.nll_ref),
                    "ppl_test": math.exp(w.nll_test),
                    "mean_kl": w.mean_kl,
                    "max_kl": w.max_kl,
                    "top1_agreement": w.top1_agreement,
                }
            )
        s = acc.summary()
        return {
            "reference": reference,
            "test": {"ppl": s["ppl_test"], "nll": s["nll_test"], "tokens": s["tokens"]},
            "ppl_ratio": s["ppl_ratio"],
            "kl": s["kl"],
            "top1_agreement": s["top1_agreement"],
            "worst": s["worst"],
            "per_window": per_window,
            "kl_histogram": kl_histogram(acc.kl_values()),
        }

    def rows(self, r: dict) -> list[Row]:
        rows: list[Row] = [
            ("perplexity", r["reference"]["ppl"], r["test"]["ppl"]),
            ("ppl ratio (test / ref)", None, r["ppl_ratio"]),
            ("top-1 agreement", None, r["top1_agreement"]),
        ]
        rows += [(f"KL {k}", None, r["kl"][k]) for k in ("mean", "p50", "p90", "p99", "max")]
        rows += [(f"worst window @{w['name']} mean KL", None, w["mean_kl"]) for w in r["worst"]]
        return rows


# ----------------------------------------------------------------------------------- passkey
def _engine(subject, **kwargs):
    """An LLM over the subject's model with these engine settings (tensor parallel: its LLM, engine rebuilt)."""
    from ..engine.llm import LLM
    from ..kvcache.base import codec_config

    name, state = codec_config(subject.kv_cache_dtype)  # a calibrated codec travels as name + state
    settings = dict(kv_cache_dtype=name, kv_calibration_state=state, enable_prefix_caching=False, **kwargs)
    if subject.llm is not None:
        subject.llm.rebuild_engine(**settings)
        return subject.llm
    return LLM(
        subject.label, loaded=(subject.model, subject.tokenizer), device=subject.model.device.type, **settings
    )  # the engine runs where the measured model is


@EVAL_TASKS.register("passkey")
class PasskeyTask(EvalTask):
    """Passkey retrieval accuracy per (length, depth) through the engine (see :mod:`bytediet.eval.longctx`)."""

    name, title = "passkey", "passkey retrieval"

    def _run(self, subject, ctx) -> dict:
        s = ctx.settings
        if subject.tokenizer is None:
            raise ConfigError("the passkey task needs a tokenizer")
        lengths = longctx.clip_lengths(s.passkey_lengths, subject.model.config.max_position_embeddings)
        prompts = longctx.make_trials(
            subject.tokenizer, ctx.corpus_ids, lengths, s.passkey_depths, s.passkey_trials, s.seed
        )
        llm = _engine(subject, max_num_batched_tokens=1024, kv_cache_memory=_kv_budget(subject, max(lengths)))
        return longctx.run_passkey(llm, prompts, ctx.progress)

    def measure_reference(self, subject, ctx) -> dict:
        return self._run(subject, ctx)

    def measure_test(self, subject, ctx, reference: dict) -> dict:
        test = self._run(subject, ctx)
        return {"reference": reference, "test": test, "accuracy_delta": test["accuracy"] - reference["accuracy"]}

    def rows(self, r: dict) -> list[Row]:
        rows: list[Row] = [("accuracy (all)", r["reference"]["accuracy"], r["test"]["accuracy"])]
        for ref_cell, cell in zip(r["reference"]["cells"], r["test"]["cells"]):
            rows.append(
                (f"accuracy @{cell['length']} tok, depth {cell['depth']:g}", ref_cell["accuracy"], cell["accuracy"])
            )
        return rows


def _kv_budget(subject, tokens: int) -> int:
    """KV bytes for one sequence of ``tokens`` (+ a block of slack per layer) with the subject's codec (tensor
    parallel: per rank, for the heads of rank 0, which holds the most)."""
    from ..kvcache import get_kv_codec

    c = subject.model.config
    per_token = get_kv_codec(subject.kv_cache_dtype, subject.model.dtype).bytes_per_token(c.num_kv_heads, c.head_dim)
    return int(per_token * c.num_layers * (tokens + 64)) + 1


# ----------------------------------------------------------------------------------- speed / memory
def _footprint(model) -> tuple[int, int, int, int]:
    """(weight bytes, decode weight bytes, peak RSS, current RSS) of one process's model (shard)."""
    return (model.weight_bytes(), model.decode_weight_bytes(), *_rss_bytes())


def _rss_bytes() -> tuple[int, int]:
    """(peak RSS of this process so far, current RSS), bytes (Linux: ru_maxrss is in KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        current = peak
    return peak, current


def _measured_read_bandwidth(device: torch.device) -> Optional[float]:
    """The measured read bandwidth (B/s) of ``device``: a GPU's (measured now if not cached), the CPU's if
    ``bytediet roofline --measure`` cached it."""
    from ..perf.measure import load_cached

    if device.type == "cuda":
        from ..perf.measure_gpu import this_gpu

        return this_gpu(str(device)).memory_bandwidth
    data = load_cached(torch.get_num_threads())
    return data.get("read_bandwidth") if data else None


@EVAL_TASKS.register("speed")
class SpeedTask(EvalTask):
    """Weight bytes, KV bytes per token, prefill and decode speed of one greedy generation, RSS.

    Decode reads every weight once per token, so ``weight bytes × decode tok/s`` is the achieved
    bandwidth (gpt-fast's roofline check); it is compared with the measured read bandwidth when
    ``bytediet roofline --measure`` has cached one.  Peak RSS is the process's peak so far
    (``getrusage``), which includes the reference that ran before; current RSS is also given.
    Tensor parallel: weight bytes and both RSS figures are summed over the ranks' processes.
    """

    name, title = "speed", "speed / memory"

    def _run(self, subject, ctx) -> dict:
        from ..engine.params import SamplingParams
        from ..kvcache import get_kv_codec

        s, c = ctx.settings, getattr(subject.model, "full_config", subject.model.config)  # KV of every rank
        prompt = ctx.windows[0].ids[: s.speed_prompt_len].tolist()
        n_ctx = len(prompt) + s.speed_new_tokens
        llm = _engine(subject, max_num_batched_tokens=512, kv_cache_memory=_kv_budget(subject, n_ctx))
        params = SamplingParams(temperature=0.0, max_tokens=s.speed_new_tokens, ignore_eos=True)
        llm.generate([prompt[:8]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
        out = llm.generate([prompt], params)[0]
        decode_s = out.finish_time - out.first_token_time
        decode_tps = (len(out.outputs[0].token_ids) - 1) / decode_s
        ranks = subject.llm.collective_rpc(_footprint) if subject.llm is not None else [_footprint(subject.model)]
        weight_bytes, decode_weight_bytes, peak, current = (sum(r[i] for r in ranks) for i in range(4))
        kv_per_token = (
            get_kv_codec(subject.kv_cache_dtype, subject.model.dtype).bytes_per_token(c.num_kv_heads, c.head_dim)
            * c.num_layers
        )
        # per decode step: all weights (a MoE model: its top-k experts) + the KV of the (average) context
        step_bytes = decode_weight_bytes + kv_per_token * (len(prompt) + s.speed_new_tokens / 2)
        ceiling = _measured_read_bandwidth(subject.model.device)
        achieved = step_bytes * decode_tps
        return {
            "weight_bytes": weight_bytes,
            "kv_bytes_per_token": kv_per_token,
            "prefill_tok_s": len(prompt) / out.ttft,
            "decode_tok_s": decode_tps,
            "achieved_gb_s": achieved / 1e9,
            "bandwidth_fraction": achieved / ceiling if ceiling else None,
            "peak_rss_bytes": peak,
            "rss_bytes": current,
            "processes": len(ranks),
            "prompt_tokens": len(prompt),
            "new_tokens": len(out.outputs[0].token_ids),
        }

    def measure_reference(self, subject, ctx) -> dict:
        return self._run(subject, ctx)

    def measure_test(self, subject, ctx, reference: dict) -> dict:
        test = self._run(subject, ctx)
        return {
            "reference": reference,
            "test": test,
            "weight_ratio": test["weight_bytes"] / reference["weight_bytes"],
            "kv_ratio": test["kv_bytes_per_token"] / reference["kv_bytes_per_token"],
            "decode_speedup": test["decode_tok_s"] / reference["decode_tok_s"],
        }

    def rows(self, r: dict) -> list[Row]:
        ref, test = r["reference"], r["test"]
        keys = [
            ("weight bytes", "weight_bytes"),
            ("KV bytes / token (all layers)", "kv_bytes_per_token"),
            ("prefill tok/s", "prefill_tok_s"),
            ("decode tok/s", "decode_tok_s"),
            ("achieved GB/s (decode)", "achieved_gb_s"),
            ("fraction of measured bandwidth", "bandwidth_fraction"),
            (f"peak RSS bytes ({_processes(test)})", "peak_rss_bytes"),
            ("RSS bytes", "rss_bytes"),
        ]
        return [(label, ref[k], test[k]) for label, k in keys] + [("decode speedup", None, r["decode_speedup"])]


def _processes(result: dict) -> str:
    n = result.get("processes", 1)
    return "process" if n == 1 else f"{n} processes"
