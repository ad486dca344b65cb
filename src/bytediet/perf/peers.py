"""The systems a benchmark runs: bytediet's engine and its peers, llama.cpp (in-process and ``llama-server``)
and Hugging Face transformers.

Each one implements :class:`bytediet.perf.bench.System`: ``serve(prompts, max_tokens, concurrency)``
answers every request greedily with exactly ``max_tokens`` tokens (end-of-sequence ignored) and
returns a :class:`~bytediet.perf.bench.RequestTiming` per request, times measured from the moment
the call starts (every request arrives then).

How each one serves ``concurrency`` requests at once:

- bytediet: continuous batching with ``max_num_seqs = concurrency`` (vLLM v1 scheduling).
- llama.cpp: the single-stream and context parts run ``llama-cpp-python``'s ``Llama`` in-process (one
  sequence per context); the concurrency sweep runs llama.cpp's own ``llama-server`` with
  ``-np = concurrency`` slots and continuous batching (:mod:`bytediet.perf.llama_server`) when it is built,
  else ``Llama`` one request after the other (queued requests wait, which their TTFT shows).
  Without ``llama-cpp-python``, llama-server runs every part. The result's ``concurrency_system`` (and the
  info's ``single_system``) say which one ran.
- llama-server alone (peer name ``llama-server``): every part over HTTP.
- transformers: ``generate`` on waves of ``concurrency`` requests, left-padded, each wave run to its
  longest output; a request counts as finished at the step that produced its last token.

Peers are optional: they are imported lazily, and a missing package or a model they cannot read
becomes :class:`~bytediet.perf.bench.Unavailable` with the reason.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from ..errors import ConfigError
from .bench import RequestTiming, Unavailable

PEERS = ("llama.cpp", "llama-server", "transformers")


class BytedietSystem:
    """bytediet's :class:`~bytediet.engine.llm.LLM` over an already-loaded ``(model, tokenizer)``, or over the
    ranks of an LLM at tensor-parallel size N (:meth:`tensor_parallel`).

    Each workload gets an engine sized for it: a new LLM over the loaded model, or — tensor parallel, whose
    ranks cannot be handed to another LLM — that LLM's engine rebuilt (:meth:`LLM.rebuild_engine`). Anything
    timed on the model itself runs on every rank at once (:meth:`LLM.collective_rpc`). :meth:`close` stops
    the ranks.
    """

    name = "bytediet"

    def __init__(
        self,
        source,
        *,
        threads: int = 2,
        kv_cache_dtype: str = "auto",
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        block_size: Optional[int] = None,
        device: str = "cpu",
        enforce_eager: bool = False,
    ) -> None:
        from ..engine.llm import LLM

        self.kv_state = None  # the calibration state of a calibrated codec (it travels with the name)
        self._ranks = None  # the tensor-parallel LLM this system drives (and shuts down)
        if isinstance(source, LLM):
            self.model, self.tokenizer = source.model, source.tokenizer
            kv_cache_dtype, self.kv_state = source.config.cache.kv_cache_dtype, source.config.cache.kv_calibration_state
            max_num_batched_tokens = source.config.scheduler.max_num_batched_tokens
            block_size = source.config.cache.block_size
            self._ranks = source if source.workers is not None else None
        else:
            self.model, self.tokenizer = source
        from ..kvcache.base import default_block_size

        self.threads, self.kv_cache_dtype = threads, kv_cache_dtype
        self.device, self.enforce_eager = device, enforce_eager  # the engine's device (the model is moved there)
        if device != "cpu" and self._ranks is None:
            from ..models.placement import move_model

            move_model(self.model, device)
        self.block_size = block_size or default_block_size(kv_cache_dtype)
        self.max_num_batched_tokens = max_num_batched_tokens
        self._llm, self._key = None, None

    @classmethod
    def tensor_parallel(
        cls,
        spec: str,
        size: int,
        *,
        threads: int = 2,
        weights: Optional[str] = None,
        activations: str = "q16",
        kv_cache_dtype: str = "auto",
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ) -> "BytedietSystem":
        """The checkpoint ``spec`` split across ``size`` processes, each loading its own shard with
        ``threads // size`` torch threads (at least 1): ``threads`` is what the whole system uses."""
        from ..engine.llm import LLM

        per_rank = max(1, threads // size)
        llm = LLM(
            spec,
            dtype="float32",
            weights=weights,
            keep_packed=True,
            activations=activations,
            kv_cache_dtype=kv_cache_dtype,
            max_num_batched_tokens=max_num_batched_tokens,
            num_blocks=1,
            num_threads=per_rank,
            tensor_parallel_size=size,
        )  # a token pool: each workload sizes its own
        return cls(llm, threads=per_rank)

    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self._ranks is None else self._ranks.config.tensor_parallel_size

    def on_ranks(self, fn, *args) -> list:
        """``fn(model, *args)`` on every rank's model at once, results in rank order (``[fn(model)]`` at size 1)."""
        if self._ranks is None:
            with torch.inference_mode():
                return [fn(self.model, *args)]
        return self._ranks.collective_rpc(fn, *args)

    def kv_codec(self):
        from ..kvcache.base import build_kv_codec

        return build_kv_codec(self.kv_cache_dtype, self.kv_state, self.model.dtype, getattr(self.model, "rope", None))

    def info(self) -> dict:
        """What runs: formats, weight bytes (all ranks together), KV codec, threads (per rank), kernels."""
        formats = self.model.weight_formats()
        sizes = self.on_ranks(_weight_bytes)
        out = {
            "system": "bytediet",
            "source": getattr(self.model, "source_path", None),
            "weights": ",".join(formats),
            "weight_bytes": sum(w for w, _ in sizes),
            "decode_weight_bytes": sum(d for _, d in sizes),
            "kv_cache_dtype": self.kv_codec().describe(self.model.config.head_dim),
            "threads": self.threads,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "concurrency_mode": "continuous batching (max_num_seqs = concurrency)",
            "kernels": self.kernels(),
        }
        if self._ranks is not None:
            out.update(
                tensor_parallel_size=self.tensor_parallel_size,
                threads_per_rank=self.threads,
                weight_bytes_per_rank=[w for w, _ in sizes],
            )
        return out

    def kernels(self) -> dict:
        """The kernel library and ISA, and whether decode steps run as one native call (and if not, why)."""
        from ..kernels import dense_gemm
        from ..kernels.cpu.dispatch import describe
        from ..models.native_decode import why_not_native

        if self.device != "cpu":  # the GPU path: which kernel runs each weight layout and the attention
            from ..engine.device import describe as describe_device

            return describe_device(
                self.model,
                self.model.new_caches(1, self.block_size, self.kv_codec()),
                "triton" + ("" if self.enforce_eager else ", CUDA graphs"),
            )
        reason = why_not_native(self.model, self.model.new_caches(1, self.block_size, self.kv_codec()))
        return {
            **describe(),
            "decode_step": "native" if reason is None else f"modules ({reason})",
            "prefill_gemm": dense_gemm.describe(),
        }

    def engine(self, concurrency: int, lengths: Sequence[int]):
        """An LLM with ``max_num_seqs = concurrency`` and a KV pool that holds the longest requests at once
        (so nothing is preempted); reused while it is big enough."""
        from ..engine.llm import LLM

        c = self.model.config
        per_token = self.kv_codec().bytes_per_token(c.num_kv_heads, c.head_dim) * c.num_layers
        longest = sorted(lengths, reverse=True)[:concurrency]
        tokens = sum(math.ceil(n / self.block_size) + 1 for n in longest) * self.block_size
        if self._key is None or self._key[0] != concurrency or self._key[1] < tokens:
            settings = dict(
                kv_cache_dtype=self.kv_cache_dtype,
                kv_calibration_state=self.kv_state,
                kv_cache_memory=int(per_token * tokens) + 1,
                block_size=self.block_size,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=concurrency,
                enable_prefix_caching=False,
            )
            self._llm = None  # free the old pool first
            if self._ranks is not None:  # per rank: its own heads' pages
                self._ranks.rebuild_engine(**settings)
                self._llm = self._ranks
            else:
                self._llm = LLM(
                    str(getattr(self.model, "source_path", "model")),
                    loaded=(self.model, self.tokenizer),
                    num_threads=self.threads,
                    device=self.device,
                    enforce_eager=self.enforce_eager,
                    **settings,
                )
            self._key = (concurrency, tokens)
        return self._llm

    def serve(self, prompts, max_tokens, concurrency) -> list[RequestTiming]:
        from ..engine.params import SamplingParams

        llm = self.engine(concurrency, [len(p) + n for p, n in zip(prompts, max_tokens)])
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        t0 = time.perf_counter()
        outs = llm.generate([list(p) for p in prompts], params)
        return [
            RequestTiming(
                len(o.prompt_token_ids), len(o.outputs[0].token_ids), o.first_token_time - t0, o.finish_time - t0
            )
            for o in outs
        ]

    def decode_steps(self, prompts: Sequence[Sequence[int]], steps: int) -> dict:
        """Time ``steps`` pure decode steps with all ``len(prompts)`` sequences running (prefill not timed).

        Returns tokens/s, seconds per step, and how much of a step the runner's forward pass took
        (the rest is scheduling, sampling and detokenization in Python).
        """
        from ..engine.params import SamplingParams

        batch = len(prompts)
        # requests prefilled early decode while the others prefill: leave room for those extra tokens
        budget = steps + math.ceil(sum(len(p) for p in prompts) / self.max_num_batched_tokens) + 2
        llm = self.engine(batch, [len(p) + budget for p in prompts])
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True)
        reqs = [engine.add_request(list(p), params) for p in prompts]
        while any(r.num_output_tokens == 0 for r in reqs):  # prefill (possibly chunked), not timed
            engine.step()
        forward0, tokens, t0 = engine.stats.forward_time, 0, time.perf_counter()
        for _ in range(steps):
            tokens += sum(len(o.new_token_ids) for o in engine.step())
        elapsed = time.perf_counter() - t0
        forward = engine.stats.forward_time - forward0
        for r in reqs:
            engine.abort_request(r.request_id)
            engine.forget(r.request_id)
        if tokens != batch * steps:
            raise ConfigError(f"decode steps: expected {batch * steps} tokens, got {tokens} (a request stalled)")
        return {
            "batch": batch,
            "steps": steps,
            "tokens_per_s": tokens / elapsed,
            "step_s": elapsed / steps,
            "forward_s_per_step": forward / steps,
            "overhead_s_per_step": (elapsed - forward) / steps,
        }

    def linear_pass_s(self, batch: int, repeats: int = 3) -> float:
        """Best time of every linear layer run once on a (batch, in_features) input: the GEMM share of one
        decode step, with no attention, norms, RoPE or Python engine around it. Tensor parallel: every rank
        runs its shard's layers at once, with their all-reduces and the logits' all-gather; the slowest rank's."""
        return max(self.on_ranks(linear_pass_s, batch, repeats))

    def measure_link(self, nbytes: int = 4 << 20, repeats: int = 20, small: int = 4096) -> dict:
        """The ranks' own all-reduce, timed (median) at ``nbytes`` → its ring bus bandwidth, and at ``small`` bytes
        → the fixed cost of one ring hop: the link the roofline needs at tensor-parallel size > 1 (Patarasuk &
        Yuan 2009: 2(N−1) hops, each rank moving 2(N−1)/N of the message)."""
        if self._ranks is None:
            raise ConfigError("measure_link: this system runs in one process; there is no link")
        from .roofline import ring_link

        n = self.tensor_parallel_size
        seconds = max(self.on_ranks(_allreduce_s, nbytes, repeats))
        small_s = max(self.on_ranks(_allreduce_s, small, repeats))
        bus, hop = ring_link(n, nbytes, seconds, small, small_s)
        return {
            "how": f"gloo all-reduce of {nbytes} and {small} bytes between the {n} ranks (median of {repeats})",
            "allreduce_s": seconds,
            "small_allreduce_s": small_s,
            "bus_bandwidth": bus,
            "hop_latency_s": hop,
        }

    def close(self) -> None:
        """Drop the engine; stop the tensor-parallel ranks, if any (the system cannot serve afterwards)."""
        self._llm = None
        if self._ranks is not None:
            self._ranks.shutdown()


def _weight_bytes(model) -> tuple[int, int]:
    return model.weight_bytes(), model.decode_weight_bytes()


def linear_pass_s(model, batch: int, repeats: int = 3) -> float:
    """Best time of ``model``'s linear layers run once each on random (batch, in_features) inputs."""
    layers = [lin for _, lin in model.linear_layers()]
    inputs = {
        n: torch.randn(batch, n, dtype=model.dtype, device=model.device) for n in {lin.in_features for lin in layers}
    }
    best = math.inf
    cuda = model.device.type == "cuda"
    for _ in range(repeats + 1):  # the first pass warms up
        t0 = time.perf_counter()
        for lin in layers:
            lin(inputs[lin.in_features])
        if cuda:  # the kernels have run, not only been queued
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _allreduce_s(model, nbytes: int, repeats: int) -> float:
    """Median seconds of one all-reduce of ``nbytes`` (float32) over the shard's tensor-parallel group."""
    x, times = torch.ones(nbytes // 4), []
    for i in range(repeats + 2):  # two warm-up rounds
        t0 = time.perf_counter()
        model.tp_group.all_reduce(x)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class LlamaCppSystem:
    """llama.cpp through ``llama-cpp-python`` on the GGUF file itself (its native quantized kernels).

    llama.cpp's CPU backend puts weights in "extra" buffer types (AMX tiles, repacked blocks) when the
    CPU advertises them. Some VMs advertise AMX but fault on its first ``ldtilecfg`` (a segfault that
    would take the whole benchmark down), so a short generation is first run in a child process; when
    it dies, the peer is loaded with the extra buffer types off and says so in :meth:`info`.
    """

    name = "llama.cpp"

    def __init__(self, gguf_path: Path, threads: int, n_ctx: int, extra_buffer_types: Optional[bool] = None) -> None:
        import llama_cpp  # optional: pip install llama-cpp-python

        self.path, self.threads, self.version = Path(gguf_path), threads, getattr(llama_cpp, "__version__", "?")
        self.extra_note = ""
        if extra_buffer_types is None:
            extra_buffer_types, self.extra_note = probe_llama_cpp_extra_buffer_types(self.path, threads)
        self.extra_buffer_types = extra_buffer_types
        with _llama_cpp_model_params(use_extra_bufts=extra_buffer_types):
            self.llm = llama_cpp.Llama(
                model_path=str(self.path),
                n_ctx=n_ctx,
                n_batch=512,
                n_threads=threads,
                n_threads_batch=threads,
                seed=0,
                verbose=False,
            )

    def info(self) -> dict:
        import llama_cpp

        system_info = llama_cpp.llama_print_system_info()
        return {
            "system": "llama.cpp",
            "package": f"llama-cpp-python {self.version}",
            "source": str(self.path),
            "system_info": system_info.decode() if isinstance(system_info, bytes) else str(system_info),
            "weights": "GGUF blocks as stored",
            "weight_bytes": gguf_tensor_bytes(self.path),
            "threads": self.threads,
            "concurrency_mode": "sequential (one sequence per llama_cpp.Llama context)",
            "extra_buffer_types": self.extra_buffer_types,
            "extra_buffer_types_note": self.extra_note,
        }

    def serve(self, prompts, max_tokens, concurrency) -> list[RequestTiming]:
        t0, out = time.perf_counter(), []
        for prompt, n in zip(prompts, max_tokens):
            self.llm.reset()  # no prefix reuse between requests
            first, count = None, 0
            for _ in self.llm.generate(
                list(prompt), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
            ):  # greedy; yields until stopped, so EOS is ignored
                count += 1
                first = first or time.perf_counter()
                if count >= n:
                    break
            out.append(RequestTiming(len(prompt), count, first - t0, time.perf_counter() - t0))
        return out

    def close(self) -> None:
        close = getattr(self.llm, "close", None)
        if close:
            close()


_PROBE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_batch=64, n_threads=int(sys.argv[2]), verbose=False)
for i, _ in enumerate(llm.generate([1, 2, 3, 4], top_k=1, temp=0.0)):
    if i == 1:
        break
"""


def probe_llama_cpp_extra_buffer_types(gguf_path: Path, threads: int, timeout_s: float = 120.0) -> tuple[bool, str]:
    """Whether llama.cpp survives a 2-token generation with its default (extra) buffer types, run in a child.

    Returns ``(use_extra_buffer_types, note)``; the note says why they were turned off.
    """
    import subprocess
    import sys

    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, str(gguf_path), str(threads)],
            capture_output=True,
            timeout=timeout_s,
            text=True,
        )
    except subprocess.TimeoutExpired:
        return False, f"probe with extra buffer types timed out after {timeout_s:.0f} s; turned off"
    if proc.returncode == 0:
        return True, ""
    how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
    return False, (
        f"a generation with llama.cpp's extra buffer types (AMX/repack) died ({how}) on this CPU; "
        "loaded with use_extra_bufts = False"
    )


class _llama_cpp_model_params:
    """Context manager: ``llama_cpp.Llama`` built inside it gets ``use_extra_bufts`` set as given.

    ``Llama.__init__`` has no argument for it, so the default-params factory it calls is wrapped.
    """

    def __init__(self, use_extra_bufts: bool) -> None:
        self.use_extra_bufts = use_extra_bufts

    def __enter__(self):
        import llama_cpp.llama as module

        self.module, self.original = module, module.llama_cpp.llama_model_default_params

        def default_params():
            params = self.original()
            params.use_extra_bufts = self.use_extra_bufts
            return params

        module.llama_cpp.llama_model_default_params = default_params
        return self

    def __exit__(self, *exc) -> None:
        self.module.llama_cpp.llama_model_default_params = self.original


class LlamaCppPeer:
    """The llama.cpp peer: ``llama-cpp-python`` for the single-stream and context parts, and ``llama-server``
    (parallel slots, continuous batching) for the concurrency sweep when it is built. Either one may be an
    :class:`Unavailable` (not both): the other then runs every part, and :meth:`info` says why."""

    name = "llama.cpp"

    def __init__(self, single, server) -> None:
        self.single, self.server = single, server  # LlamaCppSystem / LlamaServerSystem, or an Unavailable
        if isinstance(single, Unavailable) and isinstance(server, Unavailable):
            raise ConfigError(f"llama.cpp: {single.reason}; {server.reason}")

    def part_system(self, part: str):
        """The system that runs ``part`` of the benchmark."""
        first, second = (self.server, self.single) if part == "concurrency" else (self.single, self.server)
        return second if isinstance(first, Unavailable) else first

    def info(self) -> dict:
        notes = {f"{u.name}_unavailable": u.reason for u in (self.single, self.server) if isinstance(u, Unavailable)}
        return {
            **self.part_system("single").info(),
            "single_system": self.part_system("single").name,
            "concurrency_system": self.part_system("concurrency").name,
            **notes,
        }

    def serve(self, prompts, max_tokens, concurrency) -> list[RequestTiming]:
        return self.part_system("single").serve(prompts, max_tokens, concurrency)

    def close(self) -> None:
        for system in (self.single, self.server):
            if not isinstance(system, Unavailable):
                system.close()


class _StepClock:
    """A ``generate`` streamer that records when each new token (batch row) arrives; the first put is the prompt."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


class TransformersSystem:
    """Hugging Face ``generate`` (float32, greedy, batched and left-padded) on a loaded causal LM."""

    name = "transformers"

    def __init__(self, hf_model, threads: int, pad_token_id: int, source: str = "") -> None:
        self.model, self.threads, self.pad, self.source = hf_model.eval(), threads, pad_token_id, source
        self.recipe = "eager, float32"

    @classmethod
    def load(cls, path: Path, threads: int, pad_token_id: int, device: str = "cpu") -> "TransformersSystem":
        """The same checkpoint in float32: a GGUF is dequantized by ``from_pretrained(dir, gguf_file=name)``. On
        CUDA: bfloat16, a static KV cache and the forward compiled (:meth:`compile`)."""
        import transformers  # a test/bench-only dependency

        path = Path(path)
        kwargs = {"gguf_file": path.name} if path.is_file() else {}
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent if path.is_file() else path), dtype=dtype, **kwargs
        )
        system = cls(model.to(device), threads, pad_token_id, str(path))
        if device == "cuda":
            system.compile()
        return system

    def compile(self) -> None:
        """gpt-fast's recipe as transformers documents it: a static KV cache and the forward compiled with
        ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs); each batch shape compiles once."""
        self.model.generation_config.cache_implementation = "static"
        self.model.generation_config.disable_compile = True  # compiled here, not again by generate()
        self.model.forward = torch.compile(self.model.forward, mode="reduce-overhead", fullgraph=True)
        self.recipe = f"static cache + torch.compile(reduce-overhead, fullgraph), {self.model.dtype}"

    def info(self) -> dict:
        import transformers

        seen, total = set(), 0
        for p in self.model.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return {
            "system": "transformers",
            "package": f"transformers {transformers.__version__}",
            "source": self.source,
            "weights": str(self.model.dtype).replace("torch.", ""),
            "weight_bytes": total,
            "threads": self.threads,
            "recipe": self.recipe,
            "device": str(self.model.device),
            "concurrency_mode": "generate() on waves of `concurrency` requests, left-padded",
        }

    @torch.inference_mode()
    def serve(self, prompts, max_tokens, concurrency) -> list[RequestTiming]:
        torch.set_num_threads(self.threads)
        t0, out = time.perf_counter(), []
        for start in range(0, len(prompts), concurrency):
            wave, outs = prompts[start : start + concurrency], max_tokens[start : start + concurrency]
            width, steps = max(len(p) for p in wave), max(outs)
            ids = torch.full((len(wave), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(wave), width), dtype=torch.long)
            for i, p in enumerate(wave):  # left padding: the last prompt token of every row is aligned
                ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
                mask[i, width - len(p) :] = 1
            clock = _StepClock()
            ids, mask = ids.to(self.model.device), mask.to(self.model.device)
            self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                pad_token_id=self.pad,
                streamer=clock,
            )
            for p, n in zip(wave, outs):
                out.append(RequestTiming(len(p), n, clock.times[0] - t0, clock.times[n - 1] - t0))
        return out

    def close(self) -> None:
        self.model = None


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of every tensor stored in a GGUF file (what llama.cpp reads)."""
    from gguf import GGUFReader

    return int(sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors))


def make_peers(
    names: Sequence[str],
    model_path: Optional[Path],
    *,
    threads: int,
    n_ctx: int,
    pad_token_id: int,
    device: str = "cpu",
) -> list:
    """Build each named peer on the same checkpoint, or an :class:`Unavailable` that says why it cannot run."""
    peers: list = []
    for name in names:
        if name not in PEERS:
            raise ConfigError(f"unknown peer {name!r}; choose from {', '.join(PEERS)} or 'none'")
        try:
            peers.append(_load_peer(name, Path(model_path or ""), threads, n_ctx, pad_token_id, device))
        except ImportError as exc:
            package = {
                "llama.cpp": "llama-cpp-python",
                "llama-server": "llama-cpp-python",
                "transformers": "transformers",
            }[name]
            peers.append(Unavailable(name, f"{exc} (pip install {package})"))
        except ConfigError as exc:
            peers.append(Unavailable(name, str(exc)))
        except Exception as exc:  # a peer that cannot load this checkpoint is a result, not a crash
            peers.append(Unavailable(name, f"cannot load {model_path}: {type(exc).__name__}: {exc}"))
    return peers


def _load_peer(name: str, path: Path, threads: int, n_ctx: int, pad_token_id: int, device: str = "cpu"):
    is_gguf = path.is_file() and path.suffix.lower() == ".gguf"
    if name in ("llama.cpp", "llama-server"):
        from .llama_server import LlamaServerSystem

        if not is_gguf:
            raise ConfigError(f"{name} reads GGUF files only; give --model a .gguf file")
        if name == "llama-server":
            return LlamaServerSystem(path, threads)
        try:
            server = LlamaServerSystem(path, threads)
        except ConfigError as exc:
            server = Unavailable("llama-server", str(exc))
        try:
            single = LlamaCppSystem(path, threads, n_ctx)
        except ImportError as exc:
            if isinstance(server, Unavailable):
                raise
            single = Unavailable("llama-cpp-python", f"{exc} (pip install llama-cpp-python)")
        return LlamaCppPeer(single, server)
    if not (is_gguf or (path / "config.json").is_file()):
        raise ConfigError("transformers needs a GGUF file or a Hugging Face directory with config.json")
    return TransformersSystem.load(path, threads, pad_token_id, device)
