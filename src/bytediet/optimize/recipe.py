"""``bytediet optimize``: the source documents' practical recipe ("실무 적용"), automated on one model and machine.

1. **Measure first** (:mod:`.profile`): prefill vs decode through the engine, on this machine's roofline.
2. **One technique at a time**: every weight format (rounded to nearest, then calibrated by every
   registered method — AWQ, GPTQ, SmoothQuant, Wanda 2:4); the activation precision of the native kernels
   for the best weight formats (``int4-g64`` against ``int4-g64-a8`` and ``-af32``: int8 activations with
   integer dot products are faster and cost a little accuracy, :func:`.candidates.activation_specs`,
   :func:`.budget.activation_cost`); then KV byte budgets ``auto:<bits>``, each planned per layer by
   calibration (one sensitivity pass shared by every budget), beside every KV codec the registries hold as
   anchors (:mod:`.candidates`), each measured alone against the unmodified model — perplexity, KL mean/p99,
   top-1 agreement (one shared :class:`~bytediet.eval.harness.ReferenceCache`), weight bytes, KV bytes
   per token, decode tok/s.
3. **Combine the winners** (best weight format × best KV codec within budget) and re-measure: errors
   may compound (:func:`.budget.compounding`).
4. **Sensitive layers**: when a cheaper weight format misses the budget, retry it with the first/last
   decoder layers and/or ``lm_head`` kept at the most accurate format (per-module overrides).
5. **Recommend** (:func:`.budget.choose`) and write the run config (:mod:`bytediet.optimize.run_config`); a
   calibrated recommendation is saved as a quantized checkpoint next to it (:meth:`Recipe.materialize`),
   so loading it never re-calibrates.

Each measured configuration is cached on disk (:mod:`.state`) as soon as it is done, so a killed
run resumes where it stopped.
"""

from __future__ import annotations

import gc
import re
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import torch

from ..errors import BytedietError, ConfigError
from ..kvcache.auto import BudgetCodec
from ..perf.memory import release_freed
from ..progress import Bars
from .budget import Budget, activation_cost, best_of_step, compounding, objective_key, within
from .candidates import (
    Candidate,
    activation_specs,
    as_loaded_activation_modes,
    calibrated_specs,
    kv_specs,
    weight_specs,
)
from .device import build_failure, check_gpu_memory, gpu_path, objection
from .state import StepCache, model_identity, run_key
from .timebudget import QUICK_SECONDS, TimeBudget, baseline_seconds, kind_of

STEPS = ("profile", "baseline", "weights", "activations", "kv", "combined", "sensitive")
ACTIVATION_PARENTS = {"quick": 1, "full": 3}  # weight formats (the best within budget) whose activations are tried
PRESETS = {  # eval windows × len, speed and profile prompt/new tokens, calibration windows × len, passkey trials,
    # KV budgets (bits per coordinate all-in: the classes of llama.cpp's q8_0, q8_0/q4_0, q4_0 and 3.5-bit codecs)
    "quick": dict(
        windows=4,
        window_len=512,
        speed_prompt_len=32,
        speed_new_tokens=16,
        profile_prompt_len=256,
        profile_new_tokens=32,
        calib_samples=8,
        calib_len=256,
        kv_calib_windows=2,
        kv_calib_len=512,
        passkey_lengths=(1024,),
        passkey_depths=(0.25, 0.75),
        kv_budgets=(4.5,),
    ),
    "full": dict(
        windows=8,
        window_len=1024,
        speed_prompt_len=64,
        speed_new_tokens=32,
        profile_prompt_len=512,
        profile_new_tokens=64,
        calib_samples=32,
        calib_len=512,
        kv_calib_windows=2,
        kv_calib_len=1024,
        passkey_lengths=(1024, 2048, 4096),
        passkey_depths=(0.0, 0.25, 0.5, 0.75, 1.0),
        kv_budgets=(8.5, 6.0, 4.5, 3.5),
    ),
}
RECOMMENDED_MODEL_DIR = "recommended-model"
CACHE_LAYOUT = 2  # keys the step cache: 2 = reference at float activations over the blocks, logits per window


@dataclass(frozen=True)
class OptimizeOptions:
    """Everything a run depends on; ``None`` fields take the ``quick`` or ``full`` preset."""

    model: str = "default"
    quick: bool = False
    objective: str = "throughput"
    budget: Budget = field(default_factory=Budget)
    corpus: str = "prideprejudice"
    seed: int = 0
    context: int = 2048  # planning context for memory: weights + KV of one sequence this long
    windows: Optional[int] = None
    window_len: Optional[int] = None
    speed_prompt_len: Optional[int] = None
    speed_new_tokens: Optional[int] = None
    profile_prompt_len: Optional[int] = None
    profile_new_tokens: Optional[int] = None
    passkey_lengths: Optional[tuple[int, ...]] = None  # () = no passkey retrieval check
    passkey_depths: Optional[tuple[float, ...]] = None
    calib_samples: Optional[int] = None  # calibration windows (from the corpus's calibration split) ...
    calib_len: Optional[int] = None  # ... of this many tokens, for AWQ / GPTQ / SmoothQuant / Wanda
    kv_calib_windows: Optional[int] = None  # KV codecs with calibration hooks: windows of the calibration split ...
    kv_calib_len: Optional[int] = None  # ... of this many tokens (one forward pass captures K, V, Q)
    weights: Optional[tuple[str, ...]] = None  # restrict the weight candidates to these specs
    kv: Optional[tuple[str, ...]] = None  # restrict the KV candidates to these specs (budgets auto:<bits> among them)
    kv_budgets: Optional[tuple[float, ...]] = None  # KV budgets tried before the registered codecs (() = none)
    methods: Optional[tuple[str, ...]] = None  # restrict the calibration methods (() = none)
    threads: int = 2
    time_budget: Optional[float] = None  # seconds for the run (None: --quick's 15 min, no limit otherwise; 0: none)
    device: str = "auto"  # where the models, engines and calibration run (auto: cuda where torch sees a GPU)

    def resolved(self) -> "OptimizeOptions":
        """The presets filled in and ``device`` resolved (``cuda`` without a GPU is refused here, in one line)."""
        from ..engine.device import resolve_device

        preset = PRESETS["quick" if self.quick else "full"]
        budget = self.time_budget if self.time_budget is not None else (QUICK_SECONDS if self.quick else 0)
        fill = {k: v for k, v in preset.items() if getattr(self, k) is None}
        return replace(self, time_budget=budget, device=resolve_device(self.device), **fill)


def record(cand: Candidate, result: dict, context: int) -> dict:
    """One measured configuration as a flat JSON dict (the table's row and the budget's input)."""
    fid, speed = result["tasks"]["ppl"], result["tasks"]["speed"]
    test = speed["test"]
    return {
        **cand.to_dict(),
        "kv_codec": result["config"]["kv_codec"],
        "native_blocks": result["config"].get("native_blocks") or {},
        "ppl_ref": fid["reference"]["ppl"],
        "ppl": fid["test"]["ppl"],
        "ppl_increase_pct": 100.0 * (fid["ppl_ratio"] - 1.0),
        "kl_mean": fid["kl"]["mean"],
        "kl_p99": fid["kl"]["p99"],
        "kl_max": fid["kl"]["max"],
        "top1": fid["top1_agreement"],
        "weight_bytes": test["weight_bytes"],
        "kv_bytes_per_token": test["kv_bytes_per_token"],
        "memory_bytes": test["weight_bytes"] + test["kv_bytes_per_token"] * context,
        "decode_tok_s": test["decode_tok_s"],
        "prefill_tok_s": test["prefill_tok_s"],
        "decode_speedup": speed["decode_speedup"],
        "eval_s": result["elapsed_s"],
        **_passkey_fields(result["tasks"].get("passkey")),
    }


def _passkey_fields(passkey: Optional[dict]) -> dict:
    """Retrieval accuracy of the configuration and of the reference, and the drop (fractions of trials)."""
    if not passkey:
        return {"passkey": None, "passkey_ref": None, "passkey_drop": None}
    test, ref = passkey["test"]["accuracy"], passkey["reference"]["accuracy"]
    return {"passkey": test, "passkey_ref": ref, "passkey_drop": max(ref - test, 0.0)}


class Recipe:
    """One ``optimize`` run. ``on_step(name, report)`` is called after each completed step."""

    def __init__(
        self,
        options: OptimizeOptions,
        out_dir: str | Path,
        on_step: Optional[Callable[[str, dict], None]] = None,
        progress: bool = True,
    ) -> None:
        self.opt = options.resolved()
        self.out = Path(out_dir)
        self.on_step = on_step or (lambda name, report: None)
        self.progress = progress
        self.as_loaded = None  # the checkpoint as the engine runs it, when that is not its float values (_load)
        self._kv_errors: dict = {}  # weight configuration → KV sensitivity tables (shared by every budget)
        self.time = TimeBudget(self.opt.time_budget or None)
        self.device_skipped: list[dict] = []  # candidates the GPU path cannot run, with the reason (.device)

    # ------------------------------------------------------------------ set-up
    def _load(self) -> None:
        from ..eval.harness import EvalSettings, reference_cache
        from ..models.loader import load_model, native_block_types
        from ..models.placement import move_model
        from .device import device_key

        o = self.opt
        # one model in memory: the checkpoint as the engine runs it (a GGUF on its native blocks). The reference is
        # its float values (the blocks at float activations, :meth:`reference_model`); every candidate is a
        # shared_copy of it, quantized one layer at a time from those blocks (:meth:`build`)
        # (the token embedding too: a lookup decodes only its rows)
        self.model, self.tokenizer = load_model(o.model, dtype=torch.float32, keep_packed=True, packed_embedding=True)
        move_model(self.model, o.device)  # once: every candidate is a shared_copy of it, built and measured there
        self.as_loaded = self.model if native_block_types(self.model) else None
        self._reference_model = None
        self.label = getattr(self.model, "source_path", "") or str(o.model)
        self.corpus_ids = _tokenize_corpus(self.tokenizer, o.corpus)
        passkey = (
            {"passkey_lengths": o.passkey_lengths, "passkey_depths": o.passkey_depths} if o.passkey_lengths else {}
        )
        self.settings = EvalSettings(
            corpus=o.corpus,
            windows=o.windows,
            window_len=o.window_len,
            seed=o.seed,
            tasks=("ppl", "passkey", "speed") if passkey else ("ppl", "speed"),
            speed_prompt_len=o.speed_prompt_len,
            speed_new_tokens=o.speed_new_tokens,
            **passkey,
        )
        depends = {
            "layout": CACHE_LAYOUT,
            "eval": asdict(self.settings),
            "context": o.context,
            "threads": o.threads,
            "profile": [o.profile_prompt_len, o.profile_new_tokens],
            "calibration": [o.calib_samples, o.calib_len],
            "kv_calibration": self.kv_calibration,
        }
        if device_key(o.device) is not None:  # a GPU's numbers are its own (CPU runs keep their keys)
            depends["device"] = device_key(o.device)
        self._calib_windows = None
        self.key = run_key(model_identity(self.label), depends)
        self.cache = StepCache(self.out, self.key)
        self.reference = reference_cache(self.label, self.settings, directory=self.cache.reference_dir)
        self.cache.load_reference(self.reference, self.settings.windows)

    def reference_model(self):
        """The checkpoint's float values: a GGUF's blocks at float activations (dequantized in registers, or one
        layer at a time for a prefill — the same numbers as an fp32 load), sharing the loaded blocks."""
        from ..models.loader import set_activations
        from ..models.share import shared_copy

        if self.as_loaded is None:
            return self.model
        if self._reference_model is None:
            self._reference_model = shared_copy(self.model)
            set_activations(self._reference_model, "f32")
        return self._reference_model

    def reference_ready(self) -> bool:
        return self.reference.has_logits(self.settings.windows) and set(self.settings.tasks) <= set(
            self.reference.results
        )

    def speed_again(self, cand: Candidate) -> dict:
        """``cand``'s decode and prefill tok/s measured once more (the speed task alone), cached apart from its
        record so that a resumed run reuses it."""
        from ..eval.harness import evaluate_loaded

        hit = self.cache.get("speed_again", cand.label)
        if hit is not None:
            return hit
        model = self.build(cand)
        result = evaluate_loaded(
            self.reference_model(),
            self.tokenizer,
            settings=replace(self.settings, tasks=("speed",)),
            kv_cache_dtype=self.kv_codec(cand.kv, model, cand),
            reference=self.reference,
            corpus_ids=self.corpus_ids,
            progress=False,
            model_label=self.label,
            test_model=model,
        )
        test = result["tasks"]["speed"]["test"]
        again = {"decode_tok_s": test["decode_tok_s"], "prefill_tok_s": test["prefill_tok_s"]}
        self.cache.put("speed_again", cand.label, again)
        return again

    def measure(self, cand: Candidate, use_cache: bool = True) -> Optional[dict]:
        """The record of ``cand`` (from the cache, else measured now); None if the model cannot take it."""
        from ..eval.harness import evaluate_loaded

        hit = self.cache.get("configs", cand.label) if use_cache else None
        if hit is not None:
            if hit.get("device_skip"):
                self.device_skipped.append({"label": cand.label, "step": cand.step, "reason": hit["error"]})
            return {**hit, "step": cand.step} if hit.get("error") is None else None
        if cand.step != "baseline" and not self.reference_ready():
            raise AssertionError("the reference must be measured (baseline step) before any candidate")
        kind = kind_of(cand)
        if not self.time.allows(kind):
            self.time.skip(cand.label, cand.step, kind)
            return None
        t0 = time.perf_counter()
        try:
            model = self.build(cand)
        except BytedietError as exc:
            self.cache.put("configs", cand.label, {"error": str(exc)})
            return None
        except (RuntimeError, NotImplementedError) as exc:  # an op with no kernel on the device: skipped, not run
            if not gpu_path(self.opt.device):
                raise
            return self._skip_on_device(cand, build_failure(exc))
        try:
            kv = self.kv_codec(cand.kv, model, cand)
        except (RuntimeError, NotImplementedError) as exc:  # the KV calibration, likewise
            if not gpu_path(self.opt.device):
                raise
            return self._skip_on_device(cand, build_failure(exc))
        why = objection(model, kv) if gpu_path(self.opt.device) else None
        if why is not None:
            return self._skip_on_device(cand, why)
        result = evaluate_loaded(
            self.reference_model(),
            self.tokenizer,
            settings=self.settings,
            kv_cache_dtype=kv,
            reference=self.reference,
            corpus_ids=self.corpus_ids,
            progress=False,
            model_label=self.label,
            test_model=model,
        )
        rec = record(cand, result, self.opt.context)
        rec["kv_calibrated"] = not isinstance(kv, str)
        # a budget's plan is plain data: the record (and so the recommended run config) carries it
        rec["kv_calibration_state"] = kv.calibration_state() if isinstance(kv, BudgetCodec) else None
        self.cache.put("configs", cand.label, rec)
        del model, kv, result
        gc.collect()  # the candidate's layers (and any engine over them) go before the next is built
        release_freed()
        self.time.record(kind, time.perf_counter() - t0)
        return rec

    def _skip_on_device(self, cand: Candidate, reason: str) -> None:
        """``cand`` cannot run on the GPU path: listed in the report with ``reason`` (and cached so), not measured."""
        self.device_skipped.append({"label": cand.label, "step": cand.step, "reason": reason})
        self.cache.put("configs", cand.label, {"error": reason, "device_skip": True})
        gc.collect()
        return None

    def device_report(self) -> dict:
        """Where the run ran (backend, device) and what the GPU path skipped, with why."""
        from ..kernels.backend import describe

        return {**describe(self.opt.device), "skipped": list(self.device_skipped)}

    @property
    def kv_calibration(self) -> dict:
        """Where KV codecs with calibration hooks are calibrated (a run config's ``kv_calibration``)."""
        o = self.opt
        return {"corpus": o.corpus, "windows": o.kv_calib_windows, "window_len": o.kv_calib_len, "seed": o.seed}

    def kv_codec(self, spec: str, model, cand: Optional[Candidate] = None):
        """``spec`` as is, or — for a codec with calibration hooks — calibrated on ``model`` as it will run; a
        budget ``auto:<bits>`` gets its plan from the sensitivity tables of ``cand``'s weights, measured once on
        the :attr:`kv_calibration` windows and shared by every budget (the plan ``calibrate_codec`` would choose)."""
        from ..eval.harness import calibrated_kv_codec
        from ..kvcache import get_kv_codec

        codec = get_kv_codec(spec, model.dtype)
        if not isinstance(codec, BudgetCodec):
            return calibrated_kv_codec(spec, model, self.tokenizer, self.kv_calibration)
        from ..calibrate.base import CalibrationConfig
        from ..calibrate.kv_budget import measure_errors, plan_from_errors
        from ..eval.corpus import calibration_windows

        key = replace(cand, step="", kv="auto") if cand is not None else None
        sens = self._kv_errors.get(key) if key is not None else None
        if sens is None:
            cal = self.kv_calibration
            windows = calibration_windows(
                self.tokenizer,
                CalibrationConfig(
                    samples=cal["windows"], seq_len=cal["window_len"], corpus=cal["corpus"], seed=cal["seed"]
                ),
                bos=False,
            )
            sens = measure_errors(model, windows)
            if key is not None:
                self._kv_errors[key] = sens
        c = model.config
        plan = plan_from_errors(sens, codec.budget, c.num_kv_heads, c.head_dim, model)
        codec.load_calibration_state(plan.state(), rope=getattr(model, "rope", None))
        return codec

    def calibration(self):
        """(CalibrationConfig, windows): the calibration split of the run's corpus, disjoint from its eval windows."""
        from ..calibrate import CalibrationConfig
        from ..eval.corpus import calibration_windows

        calib = CalibrationConfig(
            samples=self.opt.calib_samples, seq_len=self.opt.calib_len, corpus=self.opt.corpus, seed=self.opt.seed
        )
        if self._calib_windows is None:
            self._calib_windows = calibration_windows(self.tokenizer, calib)
        return calib, self._calib_windows

    def build(self, cand: Candidate, measured: bool = True):
        """The loaded model with ``cand``'s weights (rounded, or calibrated by ``cand.method``), each layer quantized
        from the checkpoint's own blocks one at a time (:func:`~bytediet.models.share.shared_copy`); without
        weights, the checkpoint as the engine runs it (a GGUF's native blocks, at ``cand.activations``). Layers the
        weight format leaves as they are run in float32, as they would from an fp32 load. ``measured``: each layer
        kept only as the native kernels multiply it (:func:`~bytediet.models.share.native_only`), and the loaded
        model's x4 copies let go while a candidate of other weights is measured (remade when the checkpoint as
        loaded is measured again) — on the native CPU path; False for a model that is saved."""
        from contextlib import nullcontext

        from ..perf.memory import lean_heap

        # a rounded candidate's layers in their own mappings, freed whole when it is dropped; calibration's forward
        # passes stay on the heap (a mapping per activation costs a page fault per 4 kB: minutes of AWQ)
        with nullcontext() if cand.method else lean_heap():
            return self._build(cand, measured)

    def _build(self, cand: Candidate, measured: bool):
        from ..calibrate import calibrate_and_quantize
        from ..models.loader import set_activations
        from ..models.native_decode import drop_interleaved
        from ..models.quantize import QuantizeConfig, linear_layers, quantize
        from ..models.share import float_layers_as_loaded, native_only, shared_copy
        from ..perf.memory import released_after_each

        native = measured and not gpu_path(self.opt.device)  # the GPU path multiplies the planes
        if cand.weights and native:
            drop_interleaved(self.model)

        model = shared_copy(self.model)
        if cand.activations:
            set_activations(model, cand.activations)
        if cand.weights:
            config = QuantizeConfig(format=cand.weights, overrides=dict(cand.overrides))
            if cand.method:
                calib, windows = self.calibration()
                calibrate_and_quantize(model, config, cand.method, windows, calib, progress=released_after_each)
            else:
                quantize(model, config)
            float_layers_as_loaded(model, {n for n, _ in linear_layers(model) if config.spec_for(n) is None})
            if native:
                native_only(model)
        return model

    def materialize(self, report: dict) -> Optional[Path]:
        """Save a calibrated recommendation as a quantized checkpoint and point its run config at it.

        Run configs name formats, not calibration runs: without this, ``generate --config`` would either
        re-calibrate at every load or silently run the uncalibrated format. Returns the checkpoint dir.
        """
        from ..models.checkpoint import save_quantized
        from ..models.placement import move_model
        from ..models.share import float_embedding

        rec = (report.get("recommendation") or {}).get("record") or {}
        out = self.out / RECOMMENDED_MODEL_DIR
        if not rec.get("method"):
            if out.is_dir():  # left by an earlier run whose recommendation was calibrated
                shutil.rmtree(out)
            return None
        cand = self._candidate_of(rec)
        model = self.build(cand, measured=False)
        # written from host memory (on CUDA this moves the tensors it shares with the loaded model too: the run is done)
        move_model(model, "cpu")
        float_embedding(model)  # a saved checkpoint stores the float table
        save_quantized(model, self.label, out, overwrite=True)
        config = report["recommendation"]["run_config"]
        config["notes"] = {**config["notes"], "reference_model": config["model"], "calibration": rec["method"]}
        config.update(model=RECOMMENDED_MODEL_DIR, weights=None, weight_overrides={})
        return out

    # ------------------------------------------------------------------ steps
    def _profile(self, bars) -> dict:
        from .profile import profile

        hit = self.cache.get("steps", "profile")
        if hit is None:
            with bars.spin("step 1/5: profiling prefill and decode on this machine"):
                hit = profile(
                    self.as_loaded or self.model,
                    self.tokenizer,
                    self.corpus_ids,
                    prompt_len=self.opt.profile_prompt_len,
                    new_tokens=self.opt.profile_new_tokens,
                    threads=self.opt.threads,
                )
            self.cache.put("steps", "profile", hit)
        return hit

    def _baseline(self, bars) -> dict:
        if not self.reference_ready():
            self.time.check_baseline(baseline_seconds(self.report_profile, self.settings))
        with bars.spin("step 2/5: measuring the unmodified model (reference)"):
            rec = self.measure(Candidate("baseline"), use_cache=self.reference_ready())
        if rec is None and self.device_skipped:  # the checkpoint as loaded has no kernel on the device
            raise ConfigError(
                f"--device {self.opt.device}: the checkpoint as loaded cannot run there "
                f"({self.device_skipped[-1]['reason']})"
            )
        if not self.cache.reference_path.exists():
            self.cache.save_reference(self.reference, self.settings.windows)
        return rec

    def _sweep(self, bars, title: str, cands: list[Candidate]) -> list[dict]:
        records = []
        for cand in bars.track(cands, title, eta=lambda i: self.time.eta([kind_of(c) for c in cands[i:]])):
            rec = self.measure(cand)
            if rec is not None:
                records.append(rec)
        return records

    def _activations(self, bars, report: dict) -> dict:
        """The best weight configurations within budget — the checkpoint as loaded (a GGUF's own blocks) among
        them — at their other activation precisions, each record annotated with its cost against the same weights
        at their default precision (:func:`.budget.activation_cost`). Each parent is measured again here, just
        before its variants, so the speed-ups compare runs of one moment, not of minutes apart on a shared machine."""
        from ..kernels import ops

        if gpu_path(self.opt.device):
            return {
                "records": [],
                "note": f"skipped on {self.opt.device}: the activation precision (a8, af32) is a choice of the "
                "native CPU kernels; the GPU path's Triton kernels multiply every format at float activations",
            }
        if ops.native_library() is None:
            return {
                "records": [],
                "note": "no native kernels on this machine: the activation precision only "
                "changes the reference path's rounding, not its speed",
            }
        b, objective = self.opt.budget, self.opt.objective
        pool = report["steps"].get("baseline", {}).get("records", []) + report["steps"]["weights"]["records"]
        inside = sorted(
            (r for r in pool if within(r, b) and not r["overrides"]), key=lambda r: objective_key(r, objective)
        )
        parents = [p for p in inside if self._activation_variants(p)][
            : ACTIVATION_PARENTS["quick" if self.opt.quick else "full"]
        ]
        if not parents:
            return {
                "records": [],
                "note": "no weight configuration within the budget offers a choice of activation precision",
            }
        records, remeasured = [], []
        for parent in bars.track(parents, "step 2/5: activation precision of the best weight configurations"):
            fresh = {**parent, **self.speed_again(self._candidate_of(parent))}
            remeasured.append(
                {
                    "label": parent["label"],
                    "decode_tok_s": fresh["decode_tok_s"],
                    "earlier_decode_tok_s": parent["decode_tok_s"],
                }
            )
            for cand in self._activation_variants(parent):
                rec = self.measure(cand)
                if rec is not None:
                    records.append({**rec, **activation_cost(rec, fresh)})
        return {"records": records, "parents": [p["label"] for p in parents], "parents_remeasured": remeasured}

    def _activation_variants(self, parent: dict) -> list[Candidate]:
        """``parent``'s weights at the activation precisions its native kernels offer besides its own."""
        if parent["weights"]:
            return [Candidate.for_weights("activations", spec) for spec in activation_specs(_weight_spec(parent))]
        if self.as_loaded is None or parent.get("activations"):
            return []
        return [Candidate("activations", activations=mode) for mode in as_loaded_activation_modes(self.as_loaded)]

    @staticmethod
    def _candidate_of(record: dict) -> Candidate:
        return Candidate(
            record["step"],
            record["weights"],
            record["kv"],
            tuple(record["overrides"].items()),
            record.get("method"),
            record.get("activations"),
        )

    def _sensitive(self, bars, report: dict, pool: list[dict]) -> list[dict]:
        """Retry the best failing weight configuration with its sensitive layers at higher precision."""
        b, objective = self.opt.budget, self.opt.objective
        incumbent = best_of_step(pool, b, objective)
        failing = [
            r
            for r in pool
            if r["weights"]
            and not r["overrides"]
            and not within(r, b)
            and r["step"] != "activations"  # an activation precision over its own limit is not retried
            and (incumbent is None or objective_key(r, objective) < objective_key(incumbent, objective))
        ]
        if not failing:
            return []
        target = min(failing, key=lambda r: objective_key(r, objective))
        fits = [r for r in report["steps"]["weights"]["records"] if within(r, b)]
        high = min(fits, key=lambda r: r["kl_mean"])["weights"] if fits else "fp32"
        plans = override_plans(self.model, target["weights"], high)
        if self.opt.quick:
            plans = plans[-1:]
        found = []
        for overrides in bars.track(plans, f"step 4/5: keeping sensitive layers of {target['weights']} at {high}"):
            rec = self.measure(Candidate("sensitive", target["weights"], target["kv"], overrides, target.get("method")))
            if rec is not None:
                found.append(rec)
                if within(rec, b):
                    break
        return found

    def plan(self):
        """The predicted peak memory of this run (:func:`.memory_plan.plan_optimize`), from the checkpoint's header."""
        from .memory_plan import plan_optimize

        return plan_optimize(self.opt)

    def run(self) -> dict:
        from ..perf.memory import (
            WORKING_MMAP_THRESHOLD,
            StepPeaks,
            available_bytes,
            lean_heap,
            peak_rss_bytes,
            rss_bytes,
            set_mmap_threshold,
        )
        from .memory_plan import fit_to_memory

        set_mmap_threshold(WORKING_MMAP_THRESHOLD)  # fixed: glibc's own raising would keep freed layers in the heap
        t0 = self.time.start = time.perf_counter()
        plan, have, left_out = self.plan(), available_bytes() + rss_bytes(), []
        if plan.total > have:  # leave out the calibration methods that cannot fit, largest first
            fitted, left_out, fitted_plan = fit_to_memory(self.opt, have)
            if fitted_plan.total <= have:
                self.opt, plan = replace(self.opt, methods=fitted.methods), fitted_plan
            else:
                left_out = []
        plan.check(have)  # refuse before loading what the machine cannot hold
        gpu_memory = check_gpu_memory(self.opt.model, self.opt.device)  # and, on CUDA, what the GPU cannot
        o = self.opt
        with Bars(self.progress) as bars, StepPeaks() as peaks:
            bars.line(plan.describe() + (f"; time budget {o.time_budget / 60:.0f} min" if o.time_budget else ""))
            if left_out:
                bars.line(f"left out (would not fit in {have / 1e9:.1f} GB): {', '.join(left_out)}")
            with peaks.step("load"), bars.spin(f"loading {o.model} and the corpus"), lean_heap():
                self._load()
            report = {
                "model": self.label,
                "model_name": self.model.config.name or self.label,
                "options": _options_dict(o),
                "settings": asdict(self.settings),
                "cache_key": self.key,
                "budget": o.budget.to_dict(),
                "objective": o.objective,
                "kv_calibration": self.kv_calibration,
                "steps": {},
            }
            for name in STEPS:
                with peaks.step(name):
                    report["steps"][name] = self._step(name, bars, report)
                gc.collect()  # each step's candidates are gone: give their memory back before the next
                self.on_step(name, report)
        report["memory"] = {
            **plan.to_dict(),
            "measured_peak_bytes": peak_rss_bytes(),
            "steps": peaks.steps,
            "left_out": {spec: "would not fit in the memory available" for spec in left_out},
        }
        report["time_budget"] = self.time.to_dict()
        report["device"] = {**self.device_report(), "gpu_memory": gpu_memory}
        report["elapsed_s"] = time.perf_counter() - t0
        return report

    def _step(self, name: str, bars, report: dict) -> dict:
        """Run step ``name`` of :data:`STEPS`; its part of the report."""
        o = self.opt
        if name == "profile":
            self.report_profile = self._profile(bars)
            return self.report_profile
        if name == "baseline":
            return {"records": [self._baseline(bars)]}
        if name == "weights":
            rtn_only = None if o.weights is None else [s for s in o.weights if "+" not in s]
            w = weight_specs(self.model, quick=o.quick, only=rtn_only)
            recs = self._sweep(bars, "step 2/5: weight formats", [Candidate.for_weights("weights", s) for s in w.specs])
            calibrated_only = None if o.weights is None else [s for s in o.weights if "+" in s]
            c = calibrated_specs(self.model, w, quick=o.quick, methods=o.methods, only=calibrated_only)
            recs += self._sweep(
                bars, "step 2/5: calibrated weight formats", [Candidate.for_weights("weights", s) for s in c.specs]
            )
            return {"records": recs, "skipped": {**w.skipped, **c.skipped}}
        if name == "activations":
            return self._activations(bars, report)
        if name == "kv":
            k = kv_specs(self.model, quick=o.quick, only=o.kv, budgets=o.kv_budgets)
            recs = self._sweep(bars, "step 2/5: KV-cache codecs", [Candidate("kv", kv=s) for s in k.specs])
            return {"records": recs, "skipped": k.skipped}
        if name == "combined":
            return self._combine(bars, report)
        return {"records": self._sensitive(bars, report, compressed_records(report))}

    def _combine(self, bars, report: dict) -> dict:
        b, objective = self.opt.budget, self.opt.objective
        best_w = best_of_step(weight_records(report), b, objective)
        best_kv = best_of_step(report["steps"]["kv"]["records"], b, objective)
        if best_w is None or best_kv is None:
            missing = "weight format" if best_w is None else "KV codec"
            return {"records": [], "note": f"no {missing} is within the budget alone, so there is nothing to combine"}
        if not best_w["weights"] and not best_w.get("activations"):
            return {
                "records": [],
                "note": "the checkpoint's own weights beat every weight format: the KV step's "
                f"winner ({best_kv['label']}) is already the combination",
            }
        cand = Candidate(
            "combined",
            best_w["weights"],
            best_kv["kv"],
            method=best_w.get("method"),
            activations=best_w.get("activations"),
        )
        recs = self._sweep(bars, "step 3/5: combining the winners", [cand])
        return {
            "records": recs,
            "parts": [best_w["label"], best_kv["label"]],
            "compounding": compounding(best_w, best_kv, recs[0]) if recs else None,
        }


def compressed_records(report: dict) -> list[dict]:
    """Every measured configuration except the unmodified baseline, in step order."""
    return [
        r
        for step in ("weights", "activations", "kv", "combined", "sensitive")
        for r in report["steps"].get(step, {}).get("records", [])
    ]


def candidate_records(report: dict) -> list[dict]:
    """What the recommendation chooses from: the checkpoint as loaded (a GGUF's own blocks may already beat every
    re-quantization: then the answer is to keep them) and every measured configuration."""
    return report["steps"].get("baseline", {}).get("records", []) + compressed_records(report)


def weight_records(report: dict) -> list[dict]:
    """The weight-only configurations: the checkpoint as loaded, every weight format, and the activation
    precisions tried on the best."""
    return [
        r for step in ("baseline", "weights", "activations") for r in report["steps"].get(step, {}).get("records", [])
    ]


def _weight_spec(record: dict) -> str:
    """A record's weight spec with its calibration method (``int4-g64+awq``)."""
    return f"{record['weights']}+{record['method']}" if record.get("method") else record["weights"]


def override_plans(model, weights: str, high: str) -> list[tuple[tuple[str, str], ...]]:
    """Per-module overrides of ``weights`` to try, cheapest first: lm_head; first+last decoder layers; all three.

    The lm_head plan is left out when quantize's output policy already gives lm_head ``high``.
    """
    from ..models.quantize import QuantizeConfig, linear_layers

    names = [n for n, _ in linear_layers(model)]
    layers = sorted(
        {int(m.group(2)): m.group(1) for n in names if (m := re.search(r"^(.*\.layers\.)(\d+)\.", n))}.items()
    )
    head_now = QuantizeConfig(format=weights).spec_for("lm_head") or "fp32"  # None: kept as loaded (float)
    head = (("lm_head", high),) if "lm_head" in names and head_now != high else ()
    ends = ()
    if layers:
        (first, prefix), (last, _) = layers[0], layers[-1]
        ends = tuple(dict.fromkeys([(f"{prefix}{first}.*", high), (f"{prefix}{last}.*", high)]))
    plans = [p for p in (head, ends, head + ends) if p]
    return list(dict.fromkeys(plans))


def _tokenize_corpus(tokenizer, corpus: str):
    from ..eval.harness import tokenize_corpus

    try:
        return tokenize_corpus(tokenizer, corpus)
    except BytedietError as exc:
        raise BytedietError(
            f"cannot obtain the corpus {corpus!r}: {exc}. Give `bytediet optimize` any long "
            "UTF-8 text file instead: --corpus FILE"
        ) from exc


def _options_dict(o: OptimizeOptions) -> dict:
    d = asdict(o)
    d["budget"] = o.budget.to_dict()
    return d
