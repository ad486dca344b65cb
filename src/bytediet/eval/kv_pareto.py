"""``bytediet eval --kv-pareto``: every KV codec and budget on the same windows, against bf16 KV, and the frontier.

For each entry — the **anchors** (the KV formats of llama.cpp, vLLM, Hugging Face and KIVI, as registered codecs),
bytediet's **codecs**, and **budgets** ``auto:<bits>`` (plans chosen on the calibration split, one sensitivity pass
for all budgets, :mod:`bytediet.calibrate.kv_budget`) — the model scores the evaluation windows through the paged
path with that codec, and is compared position by position with the same model on bf16 KV:

* perplexity and its change [%], mean and p99 of the per-token KL(bf16 ‖ codec), top-1 agreement — by
  :class:`bytediet.eval.tasks.FidelityTask`, as ``eval`` measures them: the bf16 logits of a window are kept in a
  :class:`~bytediet.eval.harness.ReferenceCache` (in RAM up to its limit, then one file per window), and every
  entry's logits are compared a chunk of rows at a time, so memory does not grow with the windows;
* all-in bits per coordinate and bytes per token (all layers), the numbers that size the block pool;
* passkey retrieval (:class:`bytediet.eval.tasks.PasskeyTask`, through the engine) at each prompt length,
  as retrieved / trials — the same seeded prompts for every entry and for the bf16 reference row; lengths
  beyond the model's context are skipped with a note;
* ``calibrated``: which calibration the entry ran with (codecs with calibration hooks — TurboQuant's means and
  outlier channels, FP8's scales — are calibrated once on the calibration windows, as the engine runs them after
  ``--kv-calib-windows``; None: the codec has no hooks); budgets also say what their plan beat on validation;
* capacity: concurrent ``capacity_len``-token sequences the engine runs in a fixed KV memory (by default what
  ``reference_sequences`` of them take in bf16), sized by the engine itself
  (:func:`bytediet.engine.runner.sequence_capacity`: block pool and per-sequence staging).

The **frontier** is the set of entries no other entry beats on both bytes and perplexity change.

With a ``journal`` (:class:`~bytediet.eval.pareto_journal.ParetoJournal`) every finished entry is written down at
once, and a run on the same model and settings measures only the entries the journal lacks (the bf16 reference
pass runs again: the entries are compared with its logits).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from ..calibrate.kv_budget import DEFAULT_CANDIDATES, rank_correlation
from ..errors import ConfigError
from .corpus import make_windows, tokenize_corpus
from .harness import REFERENCE_RAM_BYTES, ReferenceCache

ANCHORS = ("q8_0", "fp8_vllm", "k=q8_0,v=q4_0", "q5_0", "q4_1", "q4_0", "hf4", "hf2", "kivi4", "kivi2")
OURS = ("int8", "fp8", "turboquant4", "turboquant3.5", "turboquant3", "turboquant2.5", "turboquant_prod3.5")
BUDGETS = (8.5, 6.0, 4.5, 3.5)
PASSKEY_LENGTHS = (2048, 4096, 8192)
CAPACITY_LEN = 4096


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (both minimised), by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best_y = [], float("inf")
    for i in order:
        if points[i][1] < best_y:
            front.append(i)
            best_y = points[i][1]
    return front


class Checks:
    """The per-entry measurements: fidelity on the windows against bf16 KV, passkey retrieval, engine capacity.

    ``reference`` holds the bf16 KV logits of ``windows`` once :meth:`fidelity` ran with the bf16 codec first.
    ``passkey_lengths`` beyond the model's context are dropped (listed in ``notes``); the others go to
    :class:`~bytediet.eval.tasks.PasskeyTask` as they are (it leaves room for the answer at the context's end).
    ``memory`` bytes of KV memory hold ``capacity_len``-token sequences (:func:`sequence_capacity`)."""

    def __init__(
        self,
        model,
        tokenizer,
        corpus_ids,
        windows,
        reference,
        *,
        corpus: str,
        seed: int,
        passkey_lengths: Sequence[int],
        passkey_depths: Sequence[float],
        passkey_trials: int,
        memory: int,
        capacity_len: int,
        progress,
    ) -> None:
        from .harness import EvalContext, EvalSettings

        self.model, self.tokenizer, self.memory, self.capacity_len = model, tokenizer, int(memory), capacity_len
        context = model.config.max_position_embeddings
        lengths = sorted({int(n) for n in passkey_lengths})
        self.notes = [
            f"passkey at {n} tokens skipped: beyond the model's context ({context} tokens)"
            for n in lengths
            if n > context
        ]
        self.lengths = [n for n in lengths if n <= context]
        settings = EvalSettings(
            corpus=corpus,
            seed=seed,
            tasks=("passkey",),
            passkey_lengths=self.lengths or (1,),
            passkey_depths=tuple(passkey_depths),
            passkey_trials=passkey_trials,
        )
        bos = tokenizer.encode("", add_special_tokens=True)
        self.ctx = EvalContext(settings, windows, corpus_ids, reference, bos, progress=progress)
        self.bf16: Optional[dict] = None

    def fidelity(self, spec: str, codec) -> dict:
        """:class:`~bytediet.eval.tasks.FidelityTask` on the windows: the first call (bf16 KV) fills the reference
        and returns its perplexity; later calls compare ``codec``'s logits with it, a chunk of rows at a time."""
        from .harness import Subject
        from .tasks import FidelityTask

        subject = Subject(spec, self.model, self.tokenizer, codec)
        if self.bf16 is None:
            self.bf16 = FidelityTask().measure_reference(subject, self.ctx)
            return self.bf16
        return FidelityTask().measure_test(subject, self.ctx, self.bf16)

    def passkey(self, spec: str, codec) -> Optional[list[dict]]:
        """[{"length", "retrieved", "trials"}] per prompt length (None when no length is measured)."""
        from .harness import Subject
        from .tasks import PasskeyTask

        if not self.lengths:
            return None
        answers = PasskeyTask()._run(Subject(spec, self.model, self.tokenizer, codec), self.ctx)["answers"]
        counts: dict[int, list[int]] = {}
        for a in answers:
            c = counts.setdefault(a["length"], [0, 0])
            c[0] += a["ok"]
            c[1] += 1
        return [{"length": n, "retrieved": k, "trials": t} for n, (k, t) in sorted(counts.items())]

    def capacity(self, codec) -> dict:
        from ..engine.runner import sequence_capacity
        from ..kvcache.base import default_block_size
        from ..kvcache.config import CacheConfig

        cache = CacheConfig(
            block_size=default_block_size(codec), kv_cache_memory=self.memory, kv_cache_dtype=codec.name
        )
        return sequence_capacity(codec, self.model, cache, self.capacity_len)


def _measure(model, codec, spec, kind, checks: Checks) -> dict:
    """One entry's record: perplexity change, per-token KL tail, top-1 agreement, sizes, passkey and capacity."""
    c = model.config
    bpt = codec.bytes_per_token(c.num_kv_heads, c.head_dim) * c.num_layers
    fid = checks.fidelity(spec, codec)
    rec = {
        "spec": spec,
        "kind": kind,
        "codec": codec.describe(c.head_dim),
        "bits_per_coordinate": bpt * 8 / (2 * c.num_kv_heads * c.head_dim * c.num_layers),
        "bytes_per_token": bpt,
        "ppl": fid["test"]["ppl"],
        "ppl_change_pct": 100 * (fid["ppl_ratio"] - 1),
        "kl_mean": fid["kl"]["mean"],
        "kl_p99": fid["kl"]["p99"],
        "top1_agreement": fid["top1_agreement"],
        "capacity": checks.capacity(codec),
        "passkey": checks.passkey(spec, codec),
    }
    if kind == "budget":
        rec["plan"] = codec.calibration_state()["plan"]
    return rec


def _calibration(model, tokenizer, corpus, seed, calib_windows, calib_len):
    """(windows, what they are): the corpus's calibration split, disjoint from the evaluation windows."""
    from ..calibrate.base import CalibrationConfig
    from .corpus import calibration_windows

    cal = calibration_windows(
        tokenizer, CalibrationConfig(samples=calib_windows, seq_len=calib_len, corpus=corpus, seed=seed), bos=False
    )
    return cal, f"{calib_windows} × {calib_len} tokens of {corpus}'s calibration split"


def _calibrated(codec, model, windows, note: str):
    """(codec, calibration note): calibrated on ``windows`` when it has calibration hooks, as the engine runs it
    after ``--kv-calib-windows``."""
    from ..calibrate.kv import calibrate_codec, has_calibration

    if not has_calibration(codec):
        return codec, None
    return calibrate_codec(codec, model, windows), note


def _budget_entries(model, budgets, cal, note, progress, candidates):
    """(entries, error records) of the budgets: one sensitivity pass over ``candidates`` (calibrated on the fit half
    of the calibration windows), then one plan per budget, validated on the other half."""
    from ..calibrate.kv_budget import measure_errors, plan_from_errors
    from ..kvcache import get_kv_codec

    if not budgets:
        return [], []
    c = model.config
    sens = measure_errors(model, cal, candidates, progress=progress)
    entries, failed = [], []
    for b in budgets:
        codec = get_kv_codec(f"auto:{b:g}")
        try:
            plan = plan_from_errors(sens, b, c.num_kv_heads, c.head_dim, model, progress)
        except ConfigError as exc:  # a budget below every candidate: listed with its reason
            failed.append({"spec": codec.name, "kind": "budget", "error": str(exc)})
            continue
        codec.load_calibration_state(plan.state(), rope=getattr(model, "rope", None))
        entries.append(
            (
                codec.name,
                "budget",
                codec,
                {
                    "calibrated": note,
                    "validation": plan.verdict(),
                    "validation_kl": plan.validation,
                    "chosen": plan.chosen,
                    "proxy_error": plan.estimated,
                },
            )
        )
    return entries, failed


def kv_pareto(
    model,
    tokenizer,
    *,
    corpus: str = "prideprejudice",
    windows: int = 4,
    window_len: int = 2048,
    seed: int = 0,
    anchors: Sequence[str] = ANCHORS,
    ours: Sequence[str] = OURS,
    budgets: Sequence[float] = BUDGETS,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    calib_windows: int = 1,
    calib_len: int = 512,
    passkey_lengths: Sequence[int] = PASSKEY_LENGTHS,
    passkey_depths: Sequence[float] = (0.5,),
    passkey_trials: int = 1,
    capacity_memory: Optional[int] = None,
    capacity_len: int = CAPACITY_LEN,
    reference_sequences: int = 16,
    reference_memory: int = REFERENCE_RAM_BYTES,
    progress=None,
    journal=None,
) -> dict:
    """Measure every entry; returns a JSON-ready dict (``records``, ``frontier``, ``reference``, ``settings``,
    ``notes``). ``passkey_lengths=()`` measures no passkey; ``capacity_memory`` None: the KV memory of
    ``reference_sequences`` bf16 sequences of ``capacity_len`` tokens. ``reference_memory``: bytes of bf16 logits
    kept in RAM; the windows beyond it are read back, a chunk at a time, from one temporary file each.
    ``journal``: a path; finished entries go there and a rerun skips them (see the module's docstring).
    ``candidates``: what the budgets' plans choose from per layer and half (:func:`~bytediet.calibrate.kv_candidates.
    candidate_roles`)."""
    from ..kvcache import get_kv_codec

    progress = progress or (lambda xs, desc: xs)
    t0 = time.perf_counter()
    c = model.config
    if window_len + 1 > c.max_position_embeddings:
        raise ConfigError(f"window_len {window_len} exceeds the model's context ({c.max_position_embeddings})")
    ids = tokenize_corpus(tokenizer, corpus)
    wins = make_windows(ids, window_len, windows, split="eval", seed=seed)
    ref_codec = get_kv_codec("bf16")
    ref_bpt = ref_codec.bytes_per_token(c.num_kv_heads, c.head_dim) * c.num_layers
    memory = capacity_memory or ref_bpt * capacity_len * reference_sequences
    checks = Checks(
        model,
        tokenizer,
        ids,
        wins,
        ReferenceCache(("kv-pareto",), reference_memory),
        corpus=corpus,
        seed=seed,
        passkey_lengths=passkey_lengths,
        passkey_depths=passkey_depths,
        passkey_trials=passkey_trials,
        memory=memory,
        capacity_len=capacity_len,
        progress=progress,
    )
    settings = {
        "corpus": corpus,
        "windows": windows,
        "window_len": window_len,
        "seed": seed,
        "calib_windows": calib_windows,
        "calib_len": calib_len,
        "budgets": list(budgets),
        "passkey_lengths": checks.lengths,
        "passkey_depths": list(passkey_depths),
        "passkey_trials": passkey_trials,
        "capacity_memory": int(memory),
        "capacity_len": capacity_len,
    }
    if tuple(candidates) != DEFAULT_CANDIDATES:  # recorded where chosen (journals of the defaults stay valid)
        settings["candidates"] = list(candidates)
    if journal is not None:
        from .pareto_journal import ParetoJournal

        key = {k: v for k, v in settings.items() if k != "budgets"}
        journal = ParetoJournal(journal, {"model": getattr(model, "source_path", "") or c.name, **key})
    done = (lambda spec: journal.done(spec)) if journal is not None else (lambda spec: False)
    try:
        bf16 = checks.fidelity("bf16", ref_codec)
        ref_row = {"kv_cache_dtype": "bf16", "ppl": bf16["ppl"], "tokens": bf16["tokens"], "bytes_per_token": ref_bpt}
        if journal is not None and journal.reference is not None:
            ref_row.update(journal.reference)
        else:  # first: a passkey setting that fails, fails here
            ref_row.update(capacity=checks.capacity(ref_codec), passkey=checks.passkey("bf16", ref_codec))
            if journal is not None:
                journal.set_reference({k: ref_row[k] for k in ("capacity", "passkey")})
        cal, note = _calibration(model, tokenizer, corpus, seed, calib_windows, calib_len)
        entries = []
        for kind, specs in (("anchor", anchors), ("bytediet", ours)):
            for s in specs:
                if not done(s):
                    codec, calibrated = _calibrated(get_kv_codec(s), model, cal, note)
                    entries.append((s, kind, codec, {"calibrated": calibrated}))
        measured: dict[str, dict] = {}

        def finished(rec: dict) -> None:
            measured[rec["spec"]] = rec
            if journal is not None:
                journal.add(rec)

        def measure_all(todo) -> None:
            for spec, kind, codec, extra in progress(todo, "KV codecs"):
                try:
                    finished({**_measure(model, codec, spec, kind, checks), **extra})
                except ConfigError as exc:  # e.g. a head dim the codec cannot take: listed, not fatal
                    finished({"spec": spec, "kind": kind, "error": str(exc)})

        measure_all(entries)  # first: each is journaled before the budgets' long planning starts
        todo = [b for b in budgets if not done(get_kv_codec(f"auto:{b:g}").name)]
        planned, failed = _budget_entries(model, todo, cal, note, progress, candidates)
        for rec in failed:
            finished(rec)
        measure_all(planned)
    finally:
        checks.ctx.reference.close()  # its spilled windows' files
    order = [*anchors, *ours, *(get_kv_codec(f"auto:{b:g}").name for b in budgets)]
    earlier = journal.records if journal is not None else {}
    records = [measured[s] if s in measured else earlier[s] for s in order if s in measured or s in earlier]
    if journal is not None and journal.resumed:
        checks.notes.append(f"resumed from {journal.path}: {journal.resumed} entries measured by an earlier run")
    ok = [r for r in records if "error" not in r]
    proxy = [(r["proxy_error"][n], kl) for r in ok if r.get("proxy_error") for n, kl in r["validation_kl"].items()]
    for i in pareto_front([(r["bytes_per_token"], r["ppl_change_pct"]) for r in ok]):
        ok[i]["frontier"] = True
    return {
        "model": getattr(model, "source_path", "") or c.name,
        "model_name": c.name,
        "reference": ref_row,
        "settings": settings,
        "notes": checks.notes,
        "window_starts": [w.start for w in wins],
        "records": records,
        "proxy_rank_correlation": rank_correlation([p for p, _ in proxy], [k for _, k in proxy]),
        "proxy_points": len(proxy),
        "frontier": [r["spec"] for r in sorted(ok, key=lambda r: r["bytes_per_token"]) if r.get("frontier")],
        "elapsed_s": time.perf_counter() - t0,
    }


def clip_limit(values: Sequence[float], floor: float = 5.0) -> float:
    """A y-axis top that keeps the frontier readable: 3× the median magnitude, at least ``floor``; points above
    it are drawn on the edge and listed (a +3884 % point no longer flattens the rest)."""
    mags = sorted(abs(v) for v in values)
    if not mags:
        return floor
    return max(floor, 3 * mags[len(mags) // 2])


def off_scale(records: Sequence[dict], top: float) -> list[str]:
    """``"spec: +x.x %"`` for every entry whose perplexity change lies above the axis top ``top``."""
    return [f"{r['spec']}: {r['ppl_change_pct']:+.1f} %" for r in records if r["ppl_change_pct"] > top]


def plot_kv_pareto(result: dict, path, clip: Optional[float] = None):
    """Perplexity change [%] against bytes per token: frontier dashed, anchors orange, bytediet blue, budgets green;
    x on a log axis, y clipped at :func:`clip_limit` with off-scale points listed under the plot."""
    from .plots import _pyplot, save_figure

    plt = _pyplot()
    recs = [r for r in result["records"] if "error" not in r]
    top = clip if clip is not None else clip_limit([r["ppl_change_pct"] for r in recs])
    style = {
        "anchor": ("#ee854a", "s", "anchors (llama.cpp, vLLM, HF, KIVI)"),
        "bytediet": ("#4878d0", "o", "bytediet codecs"),
        "budget": ("#6acc64", "D", "bytediet auto:<bits>"),
    }
    fig, ax = plt.subplots(figsize=(10, 6))
    off = off_scale(recs, top)
    for kind, (color, marker, label) in style.items():
        pts = [r for r in recs if r["kind"] == kind]
        if pts:
            ax.scatter(
                [r["bytes_per_token"] for r in pts],
                [min(r["ppl_change_pct"], top) for r in pts],
                c=color,
                marker=marker,
                s=50,
                label=label,
                zorder=3,
            )
        for r in pts:
            y = min(r["ppl_change_pct"], top)
            ax.annotate(r["spec"], (r["bytes_per_token"], y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    front = sorted((r for r in recs if r.get("frontier")), key=lambda r: r["bytes_per_token"])
    ax.plot(
        [r["bytes_per_token"] for r in front],
        [min(r["ppl_change_pct"], top) for r in front],
        "--",
        color="#999999",
        zorder=1,
        label="frontier",
    )
    ax.axhline(0, color="#333333", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_ylim(top=top * 1.05)
    ax.set_xlabel("KV bytes per token (all layers, all-in), log scale")
    ax.set_ylabel(f"perplexity change vs bf16 KV [%] (clipped at {top:.3g} %)")
    ax.set_title(
        f"{result['model_name']}: KV accuracy per byte ({result['settings']['windows']} × "
        f"{result['settings']['window_len']} tokens)"
    )
    if off:
        ax.text(0.01, 0.01, "off scale: " + "; ".join(off), transform=ax.transAxes, fontsize=7, va="bottom")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, plt, path)
