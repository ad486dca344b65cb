"""Memory before and during a run: what the machine has, this process's measured peak, and a planned peak.

* :func:`peak_rss_bytes`: the kernel's resident high-water mark of this process (``VmHWM``, what
  ``/usr/bin/time -v`` reports); :class:`StepPeaks`: the peak of each step of a run, sampled (the high-water
  mark itself is left alone, so the whole run's figure stays the kernel's).
* :func:`available_bytes`: what the machine can still give (``MemAvailable``, and a cgroup's limit when set).
* :func:`footprint`: the checkpoint's tensors as the loader will hold them, read from its header only.
* :class:`MemoryPlan`: a predicted peak as named parts; :meth:`MemoryPlan.check` refuses, in one line, a run
  the machine cannot hold, before anything is loaded.
"""

from __future__ import annotations

import os
import resource
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

from ..errors import BytedietError

GB = 1e9
# the interpreter, torch, bytediet, rich and the native kernel library before any model (measured: 0.242 GB resident,
# torch 2.13 CPU on Linux x86-64, bench/OPTIMIZE_MEMORY.md)
RUNTIME_BYTES = 250_000_000
# glibc's heap while a model is measured: forward passes' activations and the freed chunks kept for their reuse, and
# what earlier measurements leave in it (measured 0.47–0.51 GB above every other term of the plan, at the peak step
# of `optimize --quick`, on SmolLM2-135M, Gemma-3-270M and Qwen2.5-0.5B: bench/OPTIMIZE_MEMORY.md, session 15)
MEASURING_HEAP_BYTES = 500_000_000
# the tokenizer as loaded from a GGUF's metadata, kept for the run: its vocabulary and reverse maps per token, its BPE
# merges per merge (measured after loading: 0.20 GB for SmolLM2's 49k tokens + 49k merges, 0.39 GB for Gemma-3's 262k
# tokens, 0.32 GB for Qwen2.5's 152k tokens + 151k merges; fitted within 0.1 GB of each)
TOKENIZER_BYTES_PER_TOKEN = 1_500
TOKENIZER_BYTES_PER_MERGE = 1_000
# while loading, on top: the GGUF reader's views of every metadata array element (tokens, scores, types, merges),
# freed once the model is built (measured: 0.25 GB for SmolLM2, 0.95 GB for Gemma-3, 0.91 GB for Qwen2.5)
LOAD_BYTES_PER_TOKEN = 3_600
LOAD_BYTES_PER_MERGE = 2_000


class MemoryPlanError(BytedietError):
    """The machine cannot hold the run as asked."""


def _status_kb(field_name: str) -> Optional[int]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """This process's resident memory now."""
    kb = _status_kb("VmRSS")
    return kb * 1024 if kb is not None else peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's resident high-water mark since it started or since :func:`reset_peak_rss`."""
    kb = _status_kb("VmHWM")
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    return kb * 1024


class StepPeaks:
    """Resident memory sampled every ``interval`` seconds on a thread: ``with peaks.step(name):`` records the
    largest sample (and the resident size at its start and end) of each step in :attr:`steps`."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.steps: dict[str, int] = {}
        self._current: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "StepPeaks":
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _note(self) -> None:
        name = self._current
        if name is not None:
            self.steps[name] = max(self.steps.get(name, 0), rss_bytes())

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._note()

    @contextmanager
    def step(self, name: str):
        self._current = name
        self._note()
        try:
            yield
        finally:
            self._note()
            self._current = None


def _glibc():
    """glibc's malloc controls, or None (another C library: its allocator is left as it is)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except (OSError, AttributeError):
        return None


def release_freed() -> None:
    """Hand memory freed since the last call back to the system (glibc keeps freed heap pages otherwise, so a
    process that builds and drops one large model after another would grow by what it once held)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def released_after_each(items: Sequence, desc: str = "") -> Iterator:
    """A progress function (:mod:`bytediet.progress`) that hands freed memory back after each item: a calibration's
    blocks free transients between the packed layers they keep, which would otherwise pin the heap's holes."""
    for item in items:
        yield item
        release_freed()


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc malloc.h)
LEAN_MMAP_THRESHOLD = 1 << 20  # while a model's long-lived tensors are made: each its own mapping
WORKING_MMAP_THRESHOLD = 32 << 20  # otherwise glibc's own ceiling: a forward pass's activations reuse the heap


def set_mmap_threshold(nbytes: int) -> None:
    """Serve allocations of ``nbytes`` or more from their own mappings (returned to the system when freed); fixing
    it stops glibc's raising it after a large free. The heap's top is trimmed past twice that (glibc's own rule,
    which a fixed threshold turns off: trimming at its 128 kB default re-faults the heap on every large step)."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, nbytes)
        libc.mallopt(M_TRIM_THRESHOLD, 2 * nbytes)


@contextmanager
def lean_heap():
    """Make a model's long-lived tensors (loading, building a candidate) each in its own mapping, so that dropping
    the model gives its memory back instead of leaving holes between the heap's activations (measured: 0.6 GB of
    ``optimize``'s peak on Qwen2.5-0.5B); afterwards allocations under 32 MiB reuse the heap again (every
    activation in its own mapping costs a page fault per 4 kB: 8× the system time of an ``optimize`` run)."""
    set_mmap_threshold(LEAN_MMAP_THRESHOLD)
    try:
        yield
    finally:
        set_mmap_threshold(WORKING_MMAP_THRESHOLD)


def available_bytes() -> int:
    """Bytes the machine can still give this process: ``MemAvailable``, capped by a cgroup v2 limit if set."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(avail, 0)


@dataclass(frozen=True)
class Footprint:
    """A checkpoint as the loader holds it (bytes), from its header: no tensor is read."""

    config: object  # bytediet.config.ModelConfig
    file_bytes: int  # the checkpoint on disk
    linear: dict[str, tuple[int, int]]  # linear layer → (out, in)
    linear_loaded: dict[str, int]  # linear layer → bytes as loaded (its blocks, or float32)
    other_bytes: int  # the token embedding (float32, or its blocks with ``packed_embedding``) and norms
    linear_native: frozenset = frozenset()  # linear layers loaded in GGML blocks a native kernel multiplies
    norm_bytes: int = 0  # the norms (float32), part of other_bytes
    merges: int = 0  # the tokenizer's BPE merges (GGUF metadata)
    x4_bytes: int = 0  # linear layers in GGML blocks the native decode step copies into its x4 layout (same size)

    @property
    def tokenizer_bytes(self) -> int:
        """The tokenizer kept for the run."""
        return TOKENIZER_BYTES_PER_TOKEN * self.config.vocab_size + TOKENIZER_BYTES_PER_MERGE * self.merges

    @property
    def loading_bytes(self) -> int:
        """What loading holds for a moment beyond the model and the tokenizer: the GGUF metadata's views."""
        return LOAD_BYTES_PER_TOKEN * self.config.vocab_size + LOAD_BYTES_PER_MERGE * self.merges

    @property
    def loaded_bytes(self) -> int:
        return sum(self.linear_loaded.values()) + self.other_bytes

    @property
    def float_bytes(self) -> int:
        """Every weight in float32 (an fp32 load)."""
        c = self.config
        table = c.vocab_size * c.hidden_size * 4
        return sum(o * i * 4 for o, i in self.linear.values()) + self.norm_bytes + table

    @property
    def largest_linear_floats(self) -> int:
        return max(o * i for o, i in self.linear.values())


def footprint(spec, packed_embedding: bool = False) -> Footprint:
    """The :class:`Footprint` of the checkpoint ``spec`` loaded with its blocks packed (``keep_packed``);
    ``packed_embedding``: its token embedding kept in its blocks too (``load_model(packed_embedding=True)``)."""
    from ..kernels.ops import NATIVE_GEMM_TYPES, X4_TYPES
    from ..models.loader import build_model, load_config, resolve_model_path
    from ..quant.base import WEIGHT_FORMATS

    path = resolve_model_path(spec)
    config = load_config(path)
    skeleton = build_model(config)
    linear = {n: (lin.out_features, lin.in_features) for n, lin in skeleton.linear_layers()}
    float_linear = {n: o * i * 4 for n, (o, i) in linear.items()}
    norms = sum(p.numel() * 4 for n, p in skeleton.named_parameters() if not n.startswith(("lm_head", "model.embed")))
    table = config.vocab_size * config.hidden_size * 4  # the embedding (created on meta above), as float32
    loaded = dict(float_linear)
    native, x4, merges = set(), {}, 0
    if path.is_file():
        from ..models.gguf import GGUFCheckpoint

        ckpt = GGUFCheckpoint(path)
        tensors = list(ckpt.tensors())
        names = {t.name for t in tensors}
        for t in tensors:
            key = t.name.rpartition(".")[0]
            packable = f"gguf-{t.type_name.lower()}" in WEIGHT_FORMATS
            is_native = packable and int(t.ggml_type) in NATIVE_GEMM_TYPES
            if key in loaded and packable:
                loaded[key] = int(t.raw.nbytes)
                native |= {key} if is_native else set()
                if int(t.ggml_type) in X4_TYPES and linear[key][0] % 4 == 0:
                    x4[key] = int(t.raw.nbytes)
            if t.name == "model.embed_tokens.weight" and packable:
                tied_head = "lm_head" in loaded and "lm_head.weight" not in names
                if tied_head:
                    loaded["lm_head"] = int(t.raw.nbytes)  # tied: packed from the embedding's blocks
                    native |= {"lm_head"} if is_native else set()
                    if int(t.ggml_type) in X4_TYPES and linear["lm_head"][0] % 4 == 0:
                        x4["lm_head"] = int(t.raw.nbytes)
                if packed_embedding:
                    table = 0 if tied_head else int(t.raw.nbytes)  # a tied table's blocks are the head's
        field = ckpt.reader.fields.get("tokenizer.ggml.merges")
        merges = len(field.data) if field is not None else 0
        size = path.stat().st_size
    else:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    if config.tie_word_embeddings and loaded.get("lm_head") == float_linear.get("lm_head"):
        loaded["lm_head"] = 0  # a float tied head shares the embedding
    return Footprint(config, size, linear, loaded, table + norms, frozenset(native), norms, merges, sum(x4.values()))


@dataclass
class MemoryPlan:
    """A predicted peak: named parts in bytes, and the options that would make it smaller."""

    command: str
    parts: dict[str, int] = field(default_factory=dict)
    smaller: list[str] = field(default_factory=list)  # the options that would fit, most effective first
    largest: Optional[str] = None  # what the largest part is for (optimize: the candidate of its largest step)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in self.parts.items() if v >= 0.005 * GB)
        return f"{self.command}: predicted peak memory {self.total / GB:.2f} GB ({parts})"

    def to_dict(self) -> dict:
        return {"predicted_peak_bytes": self.total, "parts": dict(self.parts)}

    def check(self, available: Optional[int] = None) -> None:
        """Raise (one line: the need, what the machine has, what would fit) when ``available`` bytes
        (default: :func:`available_bytes` plus what this process already holds) cannot hold the plan."""
        have = available if available is not None else available_bytes() + rss_bytes()
        if self.total <= have:
            return
        fix = f"; {self.smaller[0]}" if self.smaller else ""
        raise MemoryPlanError(
            f"{self.command} needs about {self.total / GB:.1f} GB of memory and this machine has "
            f"{have / GB:.1f} GB available{fix}"
        )
