"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams)``, chat, and streaming."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from ..config import DEFAULT_MAX_NUM_BATCHED_TOKENS, SchedulerConfig
from ..errors import ConfigError
from ..kvcache.base import get_kv_codec
from ..kvcache.config import CacheConfig
from ..models.placement import move_model, one_copy_on_gpu_path, rank_device
from .config import EngineConfig, OffloadConfig
from .device import activation_reserve, kv_budget_from_free_memory, kv_bytes_free, resolve_device
from .engine import LLMEngine, StepOutput
from .params import SamplingParams
from .runner import set_threads
from .sampling import TokenLogprobs
from .speculative import SpeculativeConfig

Message = dict
DEFAULT_KV_MEMORY = "1GiB"  # the KV pool's budget on the CPU unless kv_cache_memory says otherwise
Prompt = Union[str, Sequence[int]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    stop_reason: Optional[Union[str, int]] = None
    logprobs: Optional[list[Optional[TokenLogprobs]]] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None  # SamplingParams.prompt_logprobs; None first
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict = field(default_factory=dict)  # with KV tiers: prompt tokens per "pool"/"ram"/"disk"
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


class LLM:
    """Load a model once and generate for many prompts with continuous batching.

    Keyword arguments mirror the CLI flags: ``dtype``, ``weights`` (format applied at load time),
    ``kv_cache_dtype``, ``kv_cache_memory``, ``block_size``, ``num_blocks``, ``max_num_batched_tokens``,
    ``max_num_seqs``, ``long_prefill_token_threshold``, ``scheduling_policy`` (``fcfs`` or ``priority``),
    ``enable_prefix_caching``, ``enable_chunked_prefill``, ``seed``, ``num_threads``;
    ``keep_packed`` (default True: a GGUF runs on its native blocks; ``weights="fp32"`` is the dequantized
    reference) and ``activations`` (``q16``, ``q8`` or ``f32``: how those blocks multiply).
    ``speculative_config``: speculative decoding in vLLM's JSON shape (a dict or its JSON text, e.g.
    ``{"method": "ngram", "num_speculative_tokens": 4}``; :mod:`bytediet.engine.speculative`).
    ``kv_calibration_state``: what calibration taught the ``kv_cache_dtype`` codec (plain data or a file path;
    see :class:`~bytediet.kvcache.config.CacheConfig`).
    ``loaded=(model, tokenizer)`` uses a model already loaded (and perhaps quantized); ``config.weights`` and
    ``config.weight_overrides`` then record the model's own quantization. ``tensor_parallel_size=N`` splits
    the model across N processes (:mod:`bytediet.distributed`; this one is rank 0): call :meth:`shutdown`
    to stop them before building another. :meth:`rebuild_engine` changes the engine's settings without reloading;
    :meth:`score` and :meth:`collective_rpc` run a forward pass / a function on every rank's model.
    ``device`` (``auto``, ``cpu``, ``cuda``; auto picks CUDA where torch sees a GPU) holds the model, KV pool and
    sampler; on CUDA ``kv_cache_memory=None`` (the default) sizes the pool from the free device memory,
    ``gpu_memory_utilization`` of it in all, and ``enforce_eager`` turns off the decode step's CUDA graphs.
    KV tiers (docs/kv-tiers.md): ``kv_offload_size`` (host RAM, e.g. "4GiB"), ``kv_offload_dir`` with
    ``kv_offload_disk_size`` (disk), ``kv_offload_codec`` (re-encode at rest, e.g. "rot-q8_0").
    """

    def __init__(
        self,
        model: str = "default",
        *,
        dtype: str = "float32",
        weights: Optional[str] = None,
        kv_cache_dtype: str = "auto",
        kv_cache_memory: Union[str, int, None] = None,
        block_size: Optional[int] = None,
        num_blocks: Optional[int] = None,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_num_seqs: int = 64,
        long_prefill_token_threshold: int = 0,
        scheduling_policy: str = "fcfs",
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        seed: int = 0,
        num_threads: Optional[int] = None,
        keep_packed: bool = True,
        activations: str = "q16",
        tensor_parallel_size: int = 1,
        loaded=None,
        kv_calibration_state=None,
        device: str = "auto",
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        speculative_config=None,
        kv_offload_dir: Optional[str] = None,
        kv_offload_size: Union[str, int] = 0,
        kv_offload_disk_size: Union[str, int] = "40GiB",
        kv_offload_codec: Optional[str] = None,
    ) -> None:
        from ..models.loader import load_model

        set_threads(num_threads)
        device = resolve_device(device, tensor_parallel_size)  # tensor parallel on CUDA: a GPU per rank, NCCL
        overrides = {}
        if loaded is not None and weights is None:
            # a model handed over already quantized (a run config's per-module formats): record its true spec
            quantized = getattr(loaded[0], "quantize_config", None)
            if quantized is not None:
                weights, overrides = quantized.format, dict(quantized.overrides)
        self.config = EngineConfig(
            model=str(model),
            dtype=dtype,
            weights=weights,
            weight_overrides=overrides,
            seed=seed,
            num_threads=num_threads,
            tensor_parallel_size=tensor_parallel_size,
            device=device,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            speculative=SpeculativeConfig.parse(speculative_config),
            offload=OffloadConfig(
                dir=kv_offload_dir, ram_size=kv_offload_size, disk_size=kv_offload_disk_size, codec=kv_offload_codec
            ),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory=kv_cache_memory or DEFAULT_KV_MEMORY,
                kv_cache_dtype=kv_cache_dtype,
                enable_prefix_caching=enable_prefix_caching,
                num_blocks=num_blocks,
                kv_calibration_state=kv_calibration_state,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                enable_chunked_prefill=enable_chunked_prefill,
                long_prefill_token_threshold=long_prefill_token_threshold,
                policy=scheduling_policy,
            ),
        )
        t0 = time.perf_counter()
        self.workers = None
        if tensor_parallel_size > 1:
            self.workers, self.model, self.tokenizer = _launch_tensor_parallel(
                tensor_parallel_size,
                loaded,
                num_threads,
                dict(spec=str(model), dtype=dtype, weights=weights, keep_packed=keep_packed, activations=activations),
                device,
            )
        else:
            self.model, self.tokenizer = loaded or load_model(
                model, dtype=dtype, weights=weights, keep_packed=keep_packed, activations=activations
            )
        try:
            self._place(device, kv_cache_memory is None and num_blocks is None, owned=loaded is None)
            self.load_time = time.perf_counter() - t0
            self.engine = LLMEngine(self.model, self.tokenizer, self.config, workers=self.workers)
        except BaseException:
            self.shutdown()
            raise

    def _place(self, device: str, fill_free_memory: bool, owned: bool) -> None:
        """Rank 0's model on its device (the workers moved their own shards to their GPUs), one copy of each
        quantized layer there if this engine loaded it (``owned``: nobody else re-packs it); on CUDA without a
        memory budget the KV pool gets what is free there — on every rank, the least of them."""
        move_model(self.model, rank_device(device, 0))
        if owned:
            one_copy_on_gpu_path(self.model)
        if device != "cuda" or not fill_free_memory:
            return
        sched, utilization = self.config.scheduler, self.config.gpu_memory_utilization
        reserve = activation_reserve(self.model, sched.max_num_batched_tokens, sched.max_num_seqs)
        per_rank = None
        if self.workers is not None and 0 < utilization <= 1:
            per_rank = self._on_ranks(kv_bytes_free, (utilization, reserve), gather=True)
        budget = kv_budget_from_free_memory(self.model, utilization, reserve, per_rank)
        self.config = replace(self.config, cache=replace(self.config.cache, kv_cache_memory=budget))

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot step afterwards), and close the KV tiers."""
        if getattr(self, "engine", None) is not None:
            self.engine.close()
        if self.workers is not None:
            self.workers.shutdown()

    def rebuild_engine(self, **settings) -> None:
        """Replace the engine by one with other settings over the same loaded model (and tensor-parallel ranks):
        the cache's (``kv_cache_dtype``, ``kv_calibration_state``, ``kv_cache_memory``, ``block_size``,
        ``num_blocks``, ``enable_prefix_caching``) and the scheduler's (``max_num_batched_tokens``,
        ``max_num_seqs``, ``enable_chunked_prefill``); the others keep their values, except that a new codec
        gets its default block size and a memory budget replaces ``num_blocks`` unless those are given too.
        The old engine's requests are dropped and its KV pool freed before the new one is allocated."""
        cache_keys = {f.name for f in fields(CacheConfig)}
        sched_keys = {f.name for f in fields(SchedulerConfig)}
        unknown = sorted(set(settings) - cache_keys - sched_keys)
        if unknown:
            raise ConfigError(
                f"rebuild_engine: unknown setting(s) {unknown}; choose from "
                f"{', '.join(sorted(cache_keys | sched_keys))}"
            )
        cache = {k: v for k, v in settings.items() if k in cache_keys}
        if "kv_cache_dtype" in cache:
            cache.setdefault("block_size", None)
        if "kv_cache_memory" in cache:
            cache.setdefault("num_blocks", None)
        config = replace(
            self.config,
            cache=replace(self.config.cache, **cache),
            scheduler=replace(self.config.scheduler, **{k: v for k, v in settings.items() if k in sched_keys}),
        )
        self.engine.close()  # its KV tiers' directory is released for the new engine
        self.engine = None  # its pool (and the workers' pages) goes first
        self.config = config
        self.engine = LLMEngine(self.model, self.tokenizer, config, workers=self.workers)

    # -- every rank ------------------------------------------------------------------------------
    def collective_rpc(self, fn: Callable[..., Any], *args) -> list:
        """``fn(model, *args)`` on every rank's model at once (each its shard at tensor_parallel_size > 1, so
        collectives inside meet) → the results in rank order (``[fn(model, *args)]`` at size 1). ``fn`` must be
        a module-level function (it is pickled to the workers) and its result small (it is pickled back)."""
        return self._on_ranks(fn, args, gather=True)

    def score(self, prompt: Prompt, kv_codec=None) -> torch.Tensor:
        """Logits (L, vocab) of every position of one prompt: the model's paged forward pass (:meth:`CausalLM.score`)
        over pages of its own, not the engine's pool; ``kv_codec`` (a name or codec object) defaults to the
        engine's. At tensor_parallel_size > 1 every rank runs it (the logits are all-gathered)."""
        ids = torch.tensor(self.encode(prompt), dtype=torch.long)
        vocab = self.model.config.vocab_size
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:  # checked before any rank starts
            raise ConfigError(f"score: give a non-empty prompt of token ids in [0, {vocab - 1}]")
        codec = self.engine.runner.codec if kv_codec is None else get_kv_codec(kv_codec, self.model.dtype)
        return self._on_ranks(_score, (ids, codec), gather=False)[0]

    def _on_ranks(self, fn, args: tuple, gather: bool) -> list:
        def local():
            with torch.inference_mode():
                return fn(self.model, *args)

        if self.workers is None:
            return [local()]
        return self.workers.call(fn, args, local, gather=gather)

    # -- prompts --------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("prompt: this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def chat_prompt(self, messages: Sequence[Message]) -> str:
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)

    def chat_token_ids(self, messages: Sequence[Message]) -> list[int]:
        """Render and tokenize a conversation; the template already holds BOS and special tokens."""
        return self.tokenizer.encode(self.chat_prompt(messages), add_special_tokens=False)

    def warm_up(self) -> None:
        """One short prefill and decode before serving, so the first request pays no first-use cost (kernel
        layouts, allocations); the warm-up's prompt leaves nothing in the prefix cache."""
        self._run(
            [[1 + i % 7 for i in range(8)]], [None], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        )
        self.engine.block_manager.reset_prefix_cache()

    # -- generation -----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        priority: Optional[Sequence[int]] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt together (continuous batching); results in prompt order. ``priority``: one
        integer per prompt for the ``priority`` scheduling policy (smaller first)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self.encode(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run(token_lists, texts, sampling_params, priority)

    def chat(
        self,
        conversations: Union[Sequence[Message], Sequence[Sequence[Message]]],
        sampling_params: Optional[SamplingParams] = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        rendered = [self.chat_prompt(c) for c in conversations]
        ids = [self.tokenizer.encode(r, add_special_tokens=False) for r in rendered]
        return self._run(ids, rendered, sampling_params)

    def _run(self, token_lists, texts, sampling_params, priority=None) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(token_lists)
        if len(params_list) != len(token_lists):
            raise ConfigError("sampling_params: give one per prompt, or a single one for all")
        priorities = [0] * len(token_lists) if priority is None else list(priority)
        if len(priorities) != len(token_lists):
            raise ConfigError("priority: give one per prompt")
        for ids, p in zip(token_lists, params_list):  # validate everything before queueing anything
            for i in range(p.n):
                self.engine.validate(ids, p.for_completion(i))
        outputs, children = [], {}
        for ids, text, p, rank in zip(token_lists, texts, params_list, priorities):
            ro = RequestOutput(request_id=f"gen-{len(outputs)}-{id(ids)}", prompt=text, prompt_token_ids=ids)
            outputs.append(ro)
            for i in range(p.n):
                req = self.engine.add_request(ids, p.for_completion(i), priority=rank)
                children[req.request_id] = (ro, i, req)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        for rid, (ro, i, req) in children.items():
            ro.outputs.append(
                CompletionOutput(
                    i,
                    self.engine.output_text(rid),
                    list(req.output_token_ids),
                    req.finish_reason.value if req.finish_reason else None,
                    req.stop_reason,
                    req.output_logprobs if req.params.logprobs is not None else None,
                )
            )
            ro.prompt_logprobs = ro.prompt_logprobs or req.prompt_logprobs
            ro.arrival_time = req.arrival_time
            if req.num_cached_tokens >= ro.num_cached_tokens:
                ro.cached_tokens_by_tier = dict(req.cached_tokens_by_tier)
            ro.num_cached_tokens = max(ro.num_cached_tokens, req.num_cached_tokens)
            ro.first_token_time = min(filter(None, [ro.first_token_time, req.first_token_time]), default=None)
            ro.finish_time = max(filter(None, [ro.finish_time, req.finish_time]), default=None)
            self.engine.forget(rid)
        return outputs

    def stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None) -> Iterator[StepOutput]:
        """Yield text deltas for one prompt as they are produced (other queued requests keep running)."""
        req = self.engine.add_request(self.encode(prompt), sampling_params or SamplingParams())
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == req.request_id:
                        yield out
                        if out.finished:
                            return
                if req.is_finished:
                    return
        finally:
            if not req.is_finished:
                self.engine.abort_request(req.request_id)
            self.engine.forget(req.request_id)


def _score(model, ids: torch.Tensor, codec) -> torch.Tensor:
    return model.score(ids, kv_codec=codec)


def _launch_tensor_parallel(size: int, loaded, num_threads: Optional[int], load: dict, device: str):
    """``(workers, rank 0's shard, tokenizer)``: every rank loads its own slices (a loaded model cannot be split), on
    ``device`` (CUDA: rank r on GPU r, the activations' collectives over NCCL)."""
    if loaded is not None:
        raise ConfigError(
            "tensor_parallel_size > 1: each rank loads its own shard from the checkpoint; pass the "
            "model's name or path, not a loaded model"
        )
    from ..distributed.launch import launch

    return launch(size, load, threads=num_threads, device=device)
