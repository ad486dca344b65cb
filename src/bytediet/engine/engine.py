"""The engine core: ``step()`` = schedule → run → update, plus detokenization and stop strings.

:class:`LLMEngine` is synchronous and single-threaded; :class:`bytediet.engine.llm.LLM` (offline) and
:class:`bytediet.engine.async_engine.AsyncEngine` (server) drive it.
"""

from __future__ import annotations

import atexit
import itertools
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Optional, Sequence

import torch

from ..errors import ConfigError
from .block_copy import block_copier
from .block_manager import BlockManager
from .config import EngineConfig
from .kv_tiers import build_tier_store
from .params import SamplingParams
from .request import FinishReason, Request
from .runner import ModelRunner
from .sampling import Sampler, TokenLogprobs, token_logprobs
from .scheduler import Scheduler
from .speculative import AdaptiveDraft, BatchLimit, VerifyCosts, eligible, make_proposer, verify
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
    # with the first token, when KV tiers are on: prompt tokens served by each tier ("pool", "ram", "disk")
    cached_tokens: Optional[dict[str, int]] = None


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
    spec_verifications: int = 0  # request-steps that verified speculative drafts
    spec_draft_tokens: int = 0  # drafts proposed to the target
    spec_accepted_tokens: int = 0  # drafts the target kept


class LLMEngine:
    """Owns a model runner, a scheduler and a block manager for one model."""

    def __init__(self, model, tokenizer, config: EngineConfig, workers=None) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        # decode graphs on one GPU; tensor-parallel steps run eager (a graph would hold one rank's collectives)
        eager = config.enforce_eager or workers is not None
        graphs = config.scheduler.max_num_seqs if config.device == "cuda" and not eager else 0
        # workers: tensor-parallel ranks 1..N-1; the runner owns the thread policy (ModelRunner.step_threads)
        self.runner = ModelRunner(model, config.cache, workers, config.num_threads, cuda_graphs=graphs)
        self.tiers = build_tier_store(config.offload, model, self.runner, config.cache)  # None: no KV tiers
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching, self.tiers
        )
        copier = block_copier(self.runner.caches, config.cache.block_size)
        if copier is not None and self.runner.max_sequences is None:  # every page per slot: token-granular reuse
            self.block_manager.enable_token_reuse(copier if workers is None else None)
        self._at_exit = None
        if self.tiers is not None:  # the pool's cached blocks go down to the tiers when the process ends
            self._at_exit = partial(_close_tiers, self.block_manager, self.tiers)
            atexit.register(self._at_exit)
        self.max_model_len = model.config.max_position_embeddings
        sched = config.scheduler
        if self.runner.max_sequences is not None and self.runner.max_sequences < sched.max_num_seqs:
            # the codec keeps per-sequence state in a fixed pool (KIVI's staging pages): run no more sequences
            # at once than it can hold; the rest wait (instead of failing mid-step)
            sched = replace(sched, max_num_seqs=self.runner.max_sequences)
        self.scheduler = Scheduler(sched, self.block_manager, self.max_model_len)
        self.scheduler.release_hook = self._release
        self.sampler = Sampler(seed=config.seed)
        self.speculative = config.speculative
        if config.speculative is not None and self.runner.max_sequences is not None:
            raise ConfigError(
                f"speculative decoding rolls rejected drafts back slot by slot; the KV codec "
                f"{config.cache.kv_cache_dtype!r} keeps per-sequence staging that cannot roll back: "
                "choose another --kv-cache-dtype (e.g. int8, q8_0, turboquant4) or drop "
                "--speculative-config"
            )
        self.proposer = (
            None if config.speculative is None else make_proposer(config.speculative, tokenizer, config.num_threads)
        )
        self.verify_costs = VerifyCosts()
        # the most decoding sequences that speculate (the commands replace a default one by the roofline's)
        self.spec_batch_limit = None if config.speculative is None else BatchLimit.of(config.speculative)
        self.stats = EngineStats()
        self._detok: dict[str, _Detok] = {}
        self._ids = itertools.count()
        self.eos_token_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: Optional[str] = None,
        priority: int = 0,
    ) -> Request:
        """Validate and queue one sequence (``params.n`` must be 1 here; the LLM API expands n). ``priority``:
        smaller runs first under the ``priority`` scheduling policy (ignored by ``fcfs``)."""
        ids = self.validate(prompt_token_ids, params)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ConfigError(f"priority: must be an integer, got {priority!r}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(rid, ids, params, eos_token_ids=self.eos_token_ids, priority=priority)
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
            if self.tiers is not None and any(r.tier_load is not None for r in self.scheduler.waiting):
                self.tiers.wait(0.005)  # nothing to run until a disk read lands
            return results
        t0 = time.perf_counter()  # the forward starts; a lone decode is timed from here to its next drafts
        logits = self.runner.run(out)
        elapsed = time.perf_counter() - t0
        self.stats.forward_time += elapsed
        if self.tiers is not None and all(s.num_tokens > 1 for s in out.scheduled):
            self.tiers.observe_prefill(out.num_tokens, elapsed)  # the tiers' policy: load only when faster
        self.stats.steps += 1
        sampling = [s for s in out.scheduled if s.samples]
        rows = sum(1 + len(s.drafts) for s in sampling)
        self._score_prompts(out, logits[rows:])
        sampled = self._sample(sampling, logits[:rows])
        before = {s.request.request_id: s.request.num_output_tokens for s in sampling}
        self.scheduler.update_from_output(out, sampled)
        for s in sampling:
            r = s.request
            new = r.num_output_tokens - before[r.request_id]
            self.stats.generated_tokens += new
            results.append(self._emit(r, new))
        self._propose()
        if self.proposer is not None and len(out.scheduled) == 1:
            only = out.scheduled[0]
            if only.samples and only.num_tokens == 1 + len(only.drafts):  # a lone decode: the draft rows' price
                self.verify_costs.observe(only.num_tokens, time.perf_counter() - t0)
        return results

    def _sample(self, sampling, logits: torch.Tensor) -> dict:
        """request id → (token ids, logprobs): one sampled token per plain request, the verified drafts and the
        target's own token per request that speculated (:func:`~bytediet.engine.speculative.verify`)."""
        sampled: dict = {}
        plain, plain_rows, row = [], [], 0
        for s in sampling:
            r = s.request
            if s.drafts:
                mine = logits[row : row + 1 + len(s.drafts)]
                verdict = verify(mine, s.drafts, r.params, self.sampler, r.generator)
                lps = [None] * len(verdict.tokens)
                if r.params.logprobs is not None:
                    lps = token_logprobs(
                        mine[verdict.rows], torch.tensor(verdict.tokens, device=mine.device), r.params.logprobs
                    )
                sampled[r.request_id] = (verdict.tokens, lps)
                r.draft.update(len(s.drafts), verdict.accepted_drafts)
                self.stats.spec_verifications += 1
                self.stats.spec_draft_tokens += len(s.drafts)
                self.stats.spec_accepted_tokens += verdict.accepted_drafts
            else:
                plain.append(r)
                plain_rows.append(row)
            row += 1 + len(s.drafts)
        if plain:
            first = plain_rows[0]
            contiguous = plain_rows == list(range(first, first + len(plain_rows)))
            so = self.sampler(
                logits[first : first + len(plain_rows)] if contiguous else logits[plain_rows],  # a view, no copy
                [r.params for r in plain],
                prompt_ids=[r.prompt_token_ids for r in plain],
                output_ids=[r.output_token_ids for r in plain],
                generators=[r.generator for r in plain],
            )
            for r, tok, lp in zip(plain, so.token_ids.tolist(), so.logprobs):
                sampled[r.request_id] = ([tok], [lp])
        return sampled

    def _propose(self) -> None:
        """Drafts for the next step of every decoding request that may speculate (none above the batch limit)."""
        if self.proposer is None:
            return
        decoding = [r for r in self.scheduler.running if r.num_computed_tokens + 1 == r.num_tokens]
        too_many = len(decoding) > self.spec_batch_limit.sequences
        row_cost = self.verify_costs.row_cost()
        work = []
        for r in decoding:
            r.draft_token_ids = []
            if too_many or not eligible(r.params):
                continue
            if r.draft is None:
                r.draft = AdaptiveDraft(self.speculative.num_speculative_tokens)
            k = r.draft.length(row_cost)
            if k:
                work.append((r, k))
        drafts = self.proposer.propose_many([(r.all_token_ids, k) for r, k in work]) if work else []
        for (r, _), d in zip(work, drafts):
            r.draft_token_ids = d

    @staticmethod
    def _score_prompts(out, logits: torch.Tensor) -> None:
        """Append prompt logprobs from ``logits`` (the rows after the sampling ones, :meth:`ModelRunner.prepare`)."""
        row = 0
        for s in out.scheduled:
            positions = s.prompt_logprob_positions
            if not positions:
                continue
            req = s.request
            targets = torch.tensor(req.prompt_token_ids[positions.start + 1 : positions.stop + 1], device=logits.device)
            req.prompt_logprobs += token_logprobs(
                logits[row : row + len(positions)], targets, req.params.prompt_logprobs
            )
            row += len(positions)

    def _emit(self, req: Request, count: int = 1) -> StepOutput:
        """The step's output of ``req``: its ``count`` new tokens (several after verified drafts), their text, and
        the finish; a stop string inside them ends the request there (the tokens after it are dropped)."""
        state = self._detok[req.request_id]
        first = req.num_output_tokens - count
        delta = ""
        for i in range(first, req.num_output_tokens):
            if self.tokenizer is None or state.stop.stopped:
                break
            piece = self._new_text(state, req, req.output_token_ids[i])
            last = i == req.num_output_tokens - 1
            if last and req.is_finished and state.decoder is not None:
                piece += state.decoder.flush()  # bytes held back for a character that never completed
            if piece:
                update = state.stop.feed(piece)
                delta += update.delta
                if update.stopped and not req.is_finished:
                    del req.output_token_ids[i + 1 :], req.output_logprobs[i + 1 :]
                    req.stop_reason = update.stop
                    self.scheduler.finish_requests(req.request_id, FinishReason.STOP)
        if req.is_finished:
            delta += "" if state.stop.stopped else state.stop.finish()
        tokens = req.output_token_ids[first:]
        lps = req.output_logprobs[first:] if req.output_logprobs else [None] * len(tokens)
        prompt_lps = req.prompt_logprobs if first == 0 else None
        cached = dict(req.cached_tokens_by_tier) if self.tiers is not None and first == 0 else None
        return StepOutput(
            req.request_id,
            tokens,
            delta,
            req.is_finished,
            req.finish_reason.value if req.finish_reason else None,
            lps,
            prompt_lps,
            cached,
        )

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
        piece, state.text_sent = text[state.text_sent : stable], max(state.text_sent, stable)
        return piece

    def _finished_output(self, req: Request) -> StepOutput:
        return StepOutput(
            req.request_id,
            [],
            self._detok[req.request_id].stop.finish(),
            True,
            req.finish_reason.value if req.finish_reason else None,
        )

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

    def close(self) -> None:
        """With KV tiers: hand the pool's cached blocks down, finish the disk writes, release the directory."""
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
            _close_tiers(self.block_manager, self.tiers)

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


def _close_tiers(block_manager: BlockManager, tiers) -> None:
    block_manager.offload_cached()
    tiers.close()
