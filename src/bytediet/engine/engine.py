"""The engine core: ``step()`` = schedule → run → update, plus detokenization and stop strings.

:class:`LLMEngine` is synchronous and single-threaded; :class:`bytediet.engine.llm.LLM` (offline) and
:class:`bytediet.engine.async_engine.AsyncEngine` (server) drive it.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import torch

from ..errors import ConfigError
from .block_manager import BlockManager
from .config import EngineConfig
from .params import SamplingParams
from .request import FinishReason, Request
from .runner import ModelRunner
from .sampling import Sampler, TokenLogprobs, token_logprobs
from .scheduler import Scheduler
from .stop import StopStringDetector


@dataclass
class StepOutput:
    """What one step produced for one request (streaming granularity)."""

    request_id: str
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: Optional[str] = None
    new_logprobs: list[Optional[TokenLogprobs]] = field(default_factory=list)
    # with the first token of a request that asked for prompt logprobs: one entry per prompt token (None first)
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None


@dataclass
class _Detok:
    """Per-request text state: the streaming detokenizer and the stop-string detector."""

    stop: StopStringDetector
    decoder: Any = None  # the tokenizer's IncrementalDecoder (decodes a short window per token)
    text_sent: int = 0  # fallback for tokenizers without one: characters of the full text already fed


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    forward_time: float = 0.0


class LLMEngine:
    """Owns a model runner, a scheduler and a block manager for one model."""

    def __init__(self, model, tokenizer, config: EngineConfig, workers=None) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        # workers: tensor-parallel ranks 1..N-1; the runner owns the thread policy (ModelRunner.step_threads)
        self.runner = ModelRunner(model, config.cache, workers, config.num_threads)
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.max_model_len = model.config.max_position_embeddings
        sched = config.scheduler
        if self.runner.max_sequences is not None and self.runner.max_sequences < sched.max_num_seqs:
            # the codec keeps per-sequence state in a fixed pool (KIVI's staging pages): run no more sequences
            # at once than it can hold; the rest wait (instead of failing mid-step)
            sched = replace(sched, max_num_seqs=self.runner.max_sequences)
        self.scheduler = Scheduler(sched, self.block_manager, self.max_model_len)
        self.scheduler.release_hook = self._release
        self.sampler = Sampler(seed=config.seed)
        self.stats = EngineStats()
        self._detok: dict[str, _Detok] = {}
        self._ids = itertools.count()
        self.eos_token_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    request_id: Optional[str] = None) -> Request:
        """Validate and queue one sequence (``params.n`` must be 1 here; the LLM API expands n)."""
        ids = self.validate(prompt_token_ids, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(rid, ids, params, eos_token_ids=self.eos_token_ids)
        req.seq_id = next(self._ids)
        self.scheduler.add_request(req)
        self._detok[rid] = _Detok(StopStringDetector(params.stop, params.include_stop_str_in_output))
        self.stats.prompt_tokens += len(ids)
        return req

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """Every check that can fail a request happens here, before any work is queued."""
        if not isinstance(params, SamplingParams):
            raise ConfigError("sampling params must be a bytediet SamplingParams")
        if params.n != 1:
            raise ConfigError("n: the engine core takes one sequence per request; use LLM.generate for n > 1")
        params.validate(self.model.config.vocab_size)
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ConfigError("prompt: must not be empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab - 1}]")
        if len(ids) >= self.max_model_len:
            raise ConfigError(
                f"prompt: {len(ids)} tokens do not fit the context window of {self.max_model_len} tokens "
                "(at least one token must be generated); shorten the prompt"
            )
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if len(ids) >= capacity:
            raise ConfigError(
                f"prompt: {len(ids)} tokens exceed the KV cache ({capacity} tokens); raise --kv-cache-memory"
            )
        return ids

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request at once; its blocks are freed. Returns whether it was still running."""
        return bool(self.scheduler.finish_requests(request_id, FinishReason.ABORT))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One engine iteration: schedule, run the model, sample, update; returns per-request deltas."""
        with self.runner.step_threads():
            return self._step()

    def _step(self) -> list[StepOutput]:
        out = self.scheduler.schedule()
        results = [self._finished_output(r) for r in out.finished]
        if not out:
            return results
        t0 = time.perf_counter()
        logits = self.runner.run(out)
        self.stats.forward_time += time.perf_counter() - t0
        self.stats.steps += 1
        samplers = [s.request for s in out.scheduled if s.samples]
        self._score_prompts(out, logits[len(samplers):])
        sampled: dict[str, tuple[int, Optional[TokenLogprobs]]] = {}
        if samplers:
            so = self.sampler(
                logits[:len(samplers)], [r.params for r in samplers],
                prompt_ids=[r.prompt_token_ids for r in samplers], output_ids=[r.output_token_ids for r in samplers],
                generators=[r.generator for r in samplers],
            )
            for r, tok, lp in zip(samplers, so.token_ids.tolist(), so.logprobs):
                sampled[r.request_id] = (tok, lp)
        self.scheduler.update_from_output(out, sampled)
        self.stats.generated_tokens += len(sampled)
        for r in samplers:
            results.append(self._emit(r))
        return results

    @staticmethod
    def _score_prompts(out, logits: torch.Tensor) -> None:
        """Append prompt logprobs from ``logits`` (the rows after the sampling ones, :meth:`ModelRunner.prepare`)."""
        row = 0
        for s in out.scheduled:
            positions = s.prompt_logprob_positions
            if not positions:
                continue
            req = s.request
            targets = torch.tensor(req.prompt_token_ids[positions.start + 1:positions.stop + 1], device=logits.device)
            req.prompt_logprobs += token_logprobs(logits[row:row + len(positions)], targets,
                                                  req.params.prompt_logprobs)
            row += len(positions)

    def _emit(self, req: Request) -> StepOutput:
        state = self._detok[req.request_id]
        token = req.output_token_ids[-1]
        delta = ""
        if self.tokenizer is not None and not state.stop.stopped:
            piece = self._new_text(state, req, token)
            if req.is_finished and state.decoder is not None:
                piece += state.decoder.flush()  # bytes held back for a character that never completed
            if piece:
                update = state.stop.feed(piece)
                delta = update.delta
                if update.stopped and not req.is_finished:
                    req.stop_reason = update.stop
                    self.scheduler.finish_requests(req.request_id, FinishReason.STOP)
        if req.is_finished:
            delta += "" if state.stop.stopped else state.stop.finish()
        lp = req.output_logprobs[-1] if req.output_logprobs else None
        prompt_lps = req.prompt_logprobs if req.num_output_tokens == 1 else None
        return StepOutput(req.request_id, [token], delta, req.is_finished,
                          req.finish_reason.value if req.finish_reason else None, [lp], prompt_lps)

    def _new_text(self, state: _Detok, req: Request, token: int) -> str:
        """The text ``token`` completes: O(1) per token with an incremental decoder (the full output is
        re-decoded only for tokenizers that have none), never a partial UTF-8 character."""
        skip = req.params.skip_special_tokens
        if state.decoder is None and hasattr(self.tokenizer, "incremental_decoder"):
            state.decoder = self.tokenizer.incremental_decoder(skip_special_tokens=skip)
        if state.decoder is not None:
            return state.decoder.push(token)
        text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=skip)
        stable = len(text) - 1 if text.endswith("\ufffd") else len(text)  # an incomplete UTF-8 character
        piece, state.text_sent = text[state.text_sent:stable], max(state.text_sent, stable)
        return piece

    def _finished_output(self, req: Request) -> StepOutput:
        return StepOutput(req.request_id, [], self._detok[req.request_id].stop.finish(), True,
                          req.finish_reason.value if req.finish_reason else None)

    def output_text(self, request_id: str) -> str:
        state = self._detok.get(request_id)
        return state.stop.text if state else ""

    def forget(self, request_id: str) -> None:
        """Drop the text state of a finished request (the caller has read its outputs)."""
        self._detok.pop(request_id, None)

    def _release(self, req: Request) -> None:
        if req.finish_time is None and req.is_finished:
            req.finish_time = time.perf_counter()
        self.runner.free_sequence(req.seq_id)

    # -- introspection ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def weight_bytes(self) -> int:
        return self.model.weight_bytes()

    @property
    def failure(self) -> Optional[str]:
        """Why the engine can no longer step (a tensor-parallel worker died or hung), else None."""
        workers = self.runner.workers
        return None if workers is None else workers.problem()
