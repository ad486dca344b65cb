"""``evaluate``: measure one configuration (weight format, KV codec) against the unmodified model, same run.

The *reference* is the checkpoint as loaded (no ``weights``) with the KV cache in the model's own
dtype (``"auto"``: fp32 for an fp32 model).  The *test* configuration is the same checkpoint with
a weight format applied (:func:`bytediet.models.quantize.quantize`) and/or another KV codec.

Flow: load the checkpoint once → run every task on the reference (filling a :class:`ReferenceCache`)
→ quantize the same model in place → run every task on the test configuration → each task compares
the two.  ``bytediet optimize`` keeps the :class:`ReferenceCache` and passes it back
(``reference=``), so a sweep over many configurations measures the reference only once.

Memory stays bounded for large vocabularies (Gemma-3: 262,144 logits per position): windows are
scored one at a time; the reference logits of a window are kept in RAM up to
``ReferenceCache.max_memory_bytes`` and spilled to a temporary directory beyond that.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch

from ..errors import ConfigError
from ..progress import no_progress, rich_progress
from .corpus import Window, make_windows, tokenize_corpus

DEFAULT_TASKS = ("ppl", "passkey", "speed")


@dataclass(frozen=True)
class EvalSettings:
    """What to measure and on how much data (every task reads its own fields)."""

    corpus: str = "prideprejudice"
    windows: int = 8
    window_len: int = 512
    seed: int = 0
    tasks: tuple[str, ...] = DEFAULT_TASKS
    keep_worst: int = 5
    passkey_lengths: tuple[int, ...] = (1024, 2048, 4096)
    passkey_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    passkey_trials: int = 1
    speed_prompt_len: int = 64
    speed_new_tokens: int = 32

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))
        object.__setattr__(self, "passkey_lengths", tuple(int(n) for n in self.passkey_lengths))
        object.__setattr__(self, "passkey_depths", tuple(float(d) for d in self.passkey_depths))
        if self.windows < 1 or self.window_len < 2:
            raise ConfigError(f"need windows >= 1 and window_len >= 2, got {self.windows} x {self.window_len}")
        if any(not 0.0 <= d <= 1.0 for d in self.passkey_depths):
            raise ConfigError(f"passkey depths are fractions in [0, 1], got {self.passkey_depths}")
        if self.passkey_trials < 1 or self.speed_new_tokens < 2 or self.speed_prompt_len < 1:
            raise ConfigError("passkey_trials >= 1, speed_new_tokens >= 2 and speed_prompt_len >= 1 are required")


@dataclass
class Subject:
    """One configuration under measurement: a loaded model, its tokenizer, and the KV codec spec."""

    label: str
    model: Any  # bytediet.models.transformer.CausalLM (tensor parallel: rank 0's shard)
    tokenizer: Any  # bytediet.models.tokenizer.Tokenizer (None for token-id-only tests)
    kv_cache_dtype: str = "auto"
    weights: Optional[str] = None
    llm: Any = None  # tensor parallel: the LLM over every rank, through which each task runs


HEADER_BYTES = 16  # a window file: (rows, vocab) int64, then rows × vocab float32
REFERENCE_RAM_BYTES = 512 << 20  # reference logits a ReferenceCache keeps in RAM by default


class ReferenceCache:
    """The reference model's measurements, reusable across configurations of one checkpoint.

    ``logits[i]`` (L, vocab) float32 of window ``i`` are stored in RAM while the total stays under
    ``max_memory_bytes`` and as ``.pt`` files beyond that: in ``directory`` (kept: ``bytediet optimize`` gives
    its step cache and ``max_memory_bytes=0``, so one window at a time is in memory and a resumed run reads them
    back), else a private temporary directory (deleted with the cache).
    ``results[task]`` holds each task's reference numbers (perplexity, passkey accuracy, speed).
    ``key`` identifies what was measured (model, settings) so a mismatched reuse is refused.
    """

    def __init__(
        self, key: tuple, max_memory_bytes: int = REFERENCE_RAM_BYTES, directory: Optional[Path] = None
    ) -> None:
        self.key = key
        self.max_memory_bytes = max_memory_bytes
        self.results: dict[str, dict] = {}
        self._ram: dict[int, torch.Tensor] = {}
        self._disk: dict[int, Path] = {}
        self._ram_bytes = 0
        self._dir: Optional[Path] = Path(directory) if directory is not None else None
        self._owns_dir = directory is None

    def put_logits(self, index: int, logits: torch.Tensor) -> None:
        self.put_rows(index, 0, logits, logits.shape[0])

    def put_rows(self, index: int, start: int, rows: torch.Tensor, total: int) -> None:
        """Rows ``start``.. of window ``index``'s (total, vocab) logits: a window is placed (RAM or a file) when
        its first rows arrive, so a caller scoring a window in chunks never holds the whole of it."""
        rows = rows.detach().float().contiguous()
        vocab = rows.shape[1]
        if index not in self._ram and index not in self._disk:
            size = total * vocab * 4
            if self._ram_bytes + size <= self.max_memory_bytes:
                self._ram[index] = torch.empty(total, vocab)
                self._ram_bytes += size
            else:
                self._disk[index] = self._new_file(index, total, vocab)
        if index in self._ram:
            self._ram[index][start : start + rows.shape[0]] = rows
            return
        with open(self._disk[index], "r+b") as f:
            f.seek(HEADER_BYTES + start * vocab * 4)
            f.write(rows.numpy().tobytes())

    def _new_file(self, index: int, total: int, vocab: int) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="bytediet-ref-"))
        self._dir.mkdir(parents=True, exist_ok=True)
        path = self.window_path(index)
        with open(path, "wb") as f:
            f.write(np.array([total, vocab], dtype=np.int64).tobytes())
            f.truncate(HEADER_BYTES + total * vocab * 4)
        return path

    def window_path(self, index: int) -> Path:
        return self._dir / f"window{index}.f32"

    def adopt_windows(self, count: int) -> bool:
        """Take the logits of windows 0..count-1 already in ``directory`` (an earlier run's); False if one is
        missing."""
        if self._dir is None or not all(self.window_path(i).is_file() for i in range(count)):
            return False
        self._disk.update({i: self.window_path(i) for i in range(count)})
        return True

    def rows(self, index: int, lo: int, hi: int) -> torch.Tensor:
        """Rows lo..hi-1 of window ``index``'s logits (read from its file alone when on disk)."""
        if index in self._ram:
            return self._ram[index][lo:hi]
        if index in self._disk:
            path = self._disk[index]
            total, vocab = np.fromfile(path, dtype=np.int64, count=2)
            hi = min(hi, int(total))
            data = np.fromfile(
                path, dtype=np.float32, count=(hi - lo) * int(vocab), offset=HEADER_BYTES + lo * int(vocab) * 4
            )
            return torch.from_numpy(data.reshape(hi - lo, int(vocab)))
        raise KeyError(f"the reference cache has no logits for window {index}; run the reference first")

    def logits(self, index: int) -> torch.Tensor:
        return self.rows(index, 0, 1 << 62)

    def has_logits(self, count: int) -> bool:
        return all(i in self._ram or i in self._disk for i in range(count))

    @property
    def spilled(self) -> int:
        """How many windows live on disk."""
        return len(self._disk)

    def close(self) -> None:
        """Delete a private spill directory (also done when the object is garbage-collected)."""
        if self._dir is not None and self._owns_dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir, self._disk = None, {}

    def __del__(self) -> None:
        self.close()


@dataclass
class EvalContext:
    """Shared inputs of every task: settings, evaluation windows, the reference cache, progress."""

    settings: EvalSettings
    windows: list[Window]
    corpus_ids: torch.Tensor  # (N,) int64, the whole tokenized corpus (passkey filler, speed prompts)
    reference: ReferenceCache
    bos: list[int] = field(default_factory=list)  # prepended to every scored sequence
    progress: Callable[[Sequence, str], Iterator] = no_progress


def build_context(
    tokenizer,
    settings: EvalSettings,
    reference: ReferenceCache,
    corpus_ids: Optional[torch.Tensor] = None,
    progress: bool = True,
) -> EvalContext:
    """Tokenize the corpus (unless ids are given) and cut the seeded evaluation windows."""
    ids = corpus_ids if corpus_ids is not None else tokenize_corpus(tokenizer, settings.corpus)
    windows = make_windows(ids, settings.window_len, settings.windows, split="eval", seed=settings.seed)
    bos = tokenizer.encode("", add_special_tokens=True) if tokenizer is not None else []
    return EvalContext(settings, windows, ids, reference, bos, rich_progress if progress else no_progress)


def run_tasks(reference: Subject, make_test: Callable[[], Subject], ctx: EvalContext) -> dict[str, dict]:
    """Every task on the reference (unless already cached), then on ``make_test()``, then compared."""
    from .tasks import get_eval_task

    tasks = [get_eval_task(name) for name in ctx.settings.tasks]
    for task in tasks:
        if task.name not in ctx.reference.results:
            ctx.reference.results[task.name] = task.measure_reference(reference, ctx)
    test = make_test()
    return {task.name: task.measure_test(test, ctx, ctx.reference.results[task.name]) for task in tasks}


def apply_weights(model, weights: Optional[str]) -> None:
    """Quantize every linear layer of ``model`` in place to the weight format ``weights`` (None: leave)."""
    if weights:
        from ..models.quantize import QuantizeConfig, quantize

        quantize(model, QuantizeConfig(format=weights))


def evaluate(
    model_spec: str,
    *,
    weights: Optional[str] = None,
    kv_cache_dtype: Optional[str] = None,
    windows: int = 8,
    window_len: int = 512,
    corpus: str = "prideprejudice",
    seed: int = 0,
    tasks: Sequence[str] = DEFAULT_TASKS,
    reference: Optional[ReferenceCache] = None,
    settings: Optional[EvalSettings] = None,
    progress: bool = True,
    kv_calibration: Optional[dict] = None,
    tensor_parallel_size: int = 1,
    device: str = "cpu",
    kv_offload_codec: Optional[str] = None,
) -> dict:
    """Measure ``weights`` × ``kv_cache_dtype`` on ``model_spec`` against the unmodified model.

    ``kv_calibration`` ({corpus, windows, window_len, seed}, as in a run config) calibrates a codec with
    calibration hooks on the unmodified model first (:func:`calibrated_kv_codec`).
    ``tensor_parallel_size`` N > 1: both models split across N processes (:mod:`bytediet.eval.parallel`).
    ``device`` (``cpu``, ``cuda`` or ``auto``, resolved as the engine does): where both models, their engines and the
    KV calibration run; the result's ``device`` says which, and which backend ran there.
    ``kv_offload_codec``: the KV tiers' at-rest codec (:class:`~bytediet.kvcache.at_rest.AtRestRoundTrip`): every
    full block of the test's KV round-tripped through it, as a tier hit returns it (``ppl`` only).

    The reference is the checkpoint's exact float values (a GGUF dequantized to fp32). Without ``weights`` the
    test runs the checkpoint *as the engine loads it*: a GGUF's quantized blocks on the native kernels
    (``config.native_blocks`` names them), so its speed is the speed ``generate`` and ``bench`` give.

    Returns a JSON-ready dict: ``model``, ``config``, ``reference_config``, ``settings`` and
    ``tasks[name]`` with each task's numbers (see :mod:`bytediet.eval.tasks`).  Pass a
    :class:`ReferenceCache` from an earlier call on the same model and settings to skip the reference.
    """
    from ..engine.device import resolve_device
    from ..kernels.backend import describe
    from ..models.loader import load_as_engine_runs, load_model
    from ..models.placement import move_model

    device = resolve_device(device, tensor_parallel_size)
    settings = settings or EvalSettings(
        corpus=corpus, windows=windows, window_len=window_len, seed=seed, tasks=tuple(tasks)
    )
    _check_tasks(settings.tasks)
    if kv_offload_codec and (set(settings.tasks) - {"ppl"} or tensor_parallel_size > 1):
        raise ConfigError(
            "--kv-offload-codec is scored by the ppl task on one process: use --tasks ppl and drop -tp "
            "(the engine's tasks run without the KV tiers)"
        )
    if tensor_parallel_size > 1:
        from .parallel import evaluate_tensor_parallel

        result = evaluate_tensor_parallel(
            model_spec,
            tensor_parallel_size,
            device=device,
            weights=weights,
            settings=settings,
            kv_cache_dtype=kv_cache_dtype,
            reference=reference,
            progress=progress,
            kv_calibration=kv_calibration,
        )
        return {**result, "device": describe(device)}
    reference = reference_cache(str(model_spec), settings, reference)
    t0 = time.perf_counter()
    model, tokenizer = load_model(model_spec, dtype=torch.float32)
    as_loaded = None if weights else load_as_engine_runs(model_spec)
    for m in (model, as_loaded):  # both models where they run, before the KV calibration runs either
        if m is not None:
            move_model(m, device)
    kv = kv_cache_dtype
    if kv_calibration and kv_cache_dtype:
        kv = calibrated_kv_codec(kv_cache_dtype, as_loaded or model, tokenizer, kv_calibration)
    calibrated = kv is not kv_cache_dtype
    if kv_offload_codec:
        from ..kvcache import get_kv_codec
        from ..kvcache.at_rest import AtRestRoundTrip

        kv = AtRestRoundTrip(get_kv_codec(kv or "auto", model.dtype), get_kv_codec(kv_offload_codec, model.dtype))
    result = evaluate_loaded(
        model,
        tokenizer,
        weights=weights,
        kv_cache_dtype=kv,
        settings=settings,
        reference=reference,
        progress=progress,
        model_label=str(model_spec),
        test_model=as_loaded,
    )
    result["config"]["kv_calibration"] = kv_calibration if calibrated else None
    if hasattr(kv, "plan_table"):  # a budget: the per-layer plan calibration chose
        c = model.config
        result["config"].update(
            kv_plan=kv.calibration_state()["plan"], kv_plan_table=kv.plan_table(c.num_kv_heads, c.head_dim)
        )
    result["device"] = describe(device)
    result["elapsed_s"] = time.perf_counter() - t0
    return result


def evaluate_loaded(
    model,
    tokenizer,
    *,
    settings: EvalSettings,
    weights: Optional[str] = None,
    kv_cache_dtype: Optional[str] = None,
    reference: Optional[ReferenceCache] = None,
    corpus_ids: Optional[torch.Tensor] = None,
    progress: bool = True,
    model_label: str = "",
    test_model=None,
) -> dict:
    """:func:`evaluate` on a model already loaded *unmodified* (it is quantized in place afterwards).

    ``corpus_ids`` (N,) replaces the tokenized ``settings.corpus`` (tests, pre-tokenized text).
    ``test_model``: what the test runs instead of ``model`` quantized to ``weights`` (which must then be None) —
    the checkpoint as the engine loads it (:func:`bytediet.models.loader.load_as_engine_runs`), or a
    configuration built by the caller (``optimize``); ``model`` stays the reference.
    """
    from ..kvcache import get_kv_codec
    from ..models.loader import native_block_types

    _check_tasks(settings.tasks)
    label = model_label or getattr(model, "source_path", "") or model.config.name
    reference = reference_cache(label, settings, reference)
    check_window(settings, model.config, tokenizer is not None)
    t0 = time.perf_counter()
    ctx = build_context(tokenizer, settings, reference, corpus_ids=corpus_ids, progress=progress)
    kv = kv_cache_dtype or "auto"
    kv_name = get_kv_codec(kv, model.dtype).describe(model.config.head_dim)  # fails early on an unknown codec
    if weights:
        if test_model is not None:
            raise ValueError("evaluate_loaded: give either weights (to quantize model) or test_model, not both")
        check_weights(weights)
    ref_subject = Subject("reference", model, tokenizer, "auto", None)

    def make_test() -> Subject:
        if test_model is not None:
            return Subject("test", test_model, tokenizer, kv, None)
        apply_weights(model, weights)  # the reference is done with the model: quantize it in place
        return Subject("test", model, tokenizer, kv, weights)

    results = run_tasks(ref_subject, make_test, ctx)
    blocks = native_block_types(test_model) if test_model is not None else {}
    return result_dict(label, model, ctx, results, weights, kv, kv_name, blocks, t0)


def result_dict(
    label: str,
    model,
    ctx: EvalContext,
    results: dict,
    weights: Optional[str],
    kv,
    kv_name: str,
    native_blocks: dict,
    t0: float,
) -> dict:
    """The JSON-ready result of :func:`evaluate` (``model``: the reference, or a shard of it)."""
    from ..kvcache import get_kv_codec
    from ..kvcache.at_rest import AtRestRoundTrip

    return {
        "model": label,
        "model_name": model.config.name or label,
        "config": {
            "weights": weights,
            "kv_cache_dtype": kv if isinstance(kv, str) else kv.name,
            "kv_codec": kv_name,
            "kv_offload_codec": kv.at_rest.name if isinstance(kv, AtRestRoundTrip) else None,
            "native_blocks": native_blocks,
        },
        "reference_config": {
            "weights": None,
            "kv_cache_dtype": "auto",
            "kv_codec": get_kv_codec("auto", model.dtype).describe(),
            "dtype": str(model.dtype).removeprefix("torch."),
        },
        "settings": asdict(ctx.settings),
        "window_starts": [w.start for w in ctx.windows],
        "tasks": results,
        "elapsed_s": time.perf_counter() - t0,
    }


def check_window(settings: EvalSettings, config, has_tokenizer: bool) -> None:
    """Refuse windows longer than the model's context (a BOS token takes one more position)."""
    if settings.window_len + (1 if has_tokenizer else 0) > config.max_position_embeddings:
        raise ConfigError(
            f"window_len {settings.window_len} exceeds the model's context "
            f"({config.max_position_embeddings} tokens); use a shorter --window-len"
        )


def check_weights(weights: str) -> None:
    """Fail early on an unknown weight format."""
    from ..models.quantize import QuantizeConfig

    QuantizeConfig(format=weights)


def reference_cache(
    label: str, settings: EvalSettings, reference: Optional[ReferenceCache] = None, directory: Optional[Path] = None
) -> ReferenceCache:
    """A new cache for ``label`` (the model spec, or ``model.source_path`` for :func:`evaluate_loaded`) and
    ``settings`` (``directory``: every window's logits on disk there, one in memory at a time); or ``reference``
    itself after checking that it was made for the same."""
    key = (label, replace(settings, tasks=()))  # a reused cache may lack a task: it is measured then
    if reference is None:
        return ReferenceCache(key) if directory is None else ReferenceCache(key, 0, directory)
    if reference.key != key:
        raise ConfigError(
            "the reference cache was measured for another model or other settings; "
            "pass the same model and settings, or no reference"
        )
    return reference


def _check_tasks(names: Sequence[str]) -> None:
    from .tasks import EVAL_TASKS

    unknown = [n for n in names if n not in EVAL_TASKS]
    if unknown or not names:
        raise ConfigError(f"unknown eval task(s) {unknown or names}; choose from: {', '.join(EVAL_TASKS.names())}")


def calibrated_kv_codec(spec: str, model, tokenizer, calibration: Mapping[str, Any]):
    """The codec ``spec`` calibrated on ``calibration``'s windows ({corpus, windows, window_len, seed}, as in a run
    config); ``spec`` itself (the string) if the codec has no calibration hooks, so callers can tell a calibrated
    codec by ``result is not spec``."""
    from ..calibrate.base import CalibrationConfig
    from ..calibrate.kv import calibrate_codec, has_calibration
    from ..kvcache import get_kv_codec
    from .corpus import calibration_windows

    codec = get_kv_codec(spec, model.dtype)
    if not has_calibration(codec):
        return spec
    windows = calibration_windows(
        tokenizer,
        CalibrationConfig(
            samples=calibration["windows"],
            seq_len=calibration["window_len"],
            corpus=calibration["corpus"],
            seed=calibration["seed"],
        ),
        bos=False,
    )
    return calibrate_codec(codec, model, windows)
