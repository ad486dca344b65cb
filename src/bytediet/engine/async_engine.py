"""``AsyncEngine``: the engine loop on a background thread, streams as async iterators (for the server).

The model's forward pass blocks, so one engine thread runs ``step()`` while requests arrive from an
asyncio event loop. Commands (add, abort) cross over through a thread-safe queue; outputs come back
to each request's ``asyncio.Queue`` with ``call_soon_threadsafe``. A consumer that stops iterating
(a client that disconnected) aborts its request, which frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from typing import AsyncIterator, Optional, Sequence

from .engine import LLMEngine, StepOutput
from .params import SamplingParams
from .snapshot import EngineCounters, EngineInfo, engine_counters, engine_info


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: "queue.Queue[tuple]" = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = False
        self._error: Optional[BaseException] = None
        self._info: Optional[EngineInfo] = None
        self._thread = threading.Thread(target=self._loop, name="bytediet-engine", daemon=True)
        self._thread.start()

    # -- public API (event-loop side) ---------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: Optional[str] = None,
        priority: int = 0,
    ) -> AsyncIterator[StepOutput]:
        """Validate, queue and stream one request; raises ``ConfigError`` before queueing on bad input."""
        ids = self.engine.validate(prompt_token_ids, params)  # read-only checks: safe off-thread
        rid = request_id or f"async-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (loop, outputs)
        self._send(("add", rid, ids, params, priority))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.engine.close()

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs (the server's health check)."""
        return self._thread.is_alive()

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    # -- what the server reads (the same on EngineProcess, the out-of-process engine) -------------
    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            self._info = engine_info(self.engine)
        return self._info

    def counters(self) -> EngineCounters:
        return engine_counters(self.engine)

    @property
    def failure(self) -> Optional[str]:
        return self.engine.failure

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        return self.engine.validate(prompt_token_ids, params)  # read-only checks: safe off-thread

    # -- engine thread --------------------------------------------------------------------------
    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, ids, params, priority = cmd
                try:
                    self.engine.add_request(ids, params, request_id=rid, priority=priority)
                except Exception as exc:  # e.g. a duplicate id: report to that stream only
                    self._deliver(rid, exc)
            elif cmd[0] == "abort":
                self.engine.abort_request(cmd[1])
                self.engine.forget(cmd[1])

    def _deliver(self, rid: str, item) -> None:
        target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _deliver_step(self, outputs: list[StepOutput]) -> None:
        """A step's outputs to their streams: one ``call_soon_threadsafe`` (one self-pipe write) per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _loop(self) -> None:
        while not self._stop:
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug, not bad input: fail the streams in flight, keep serving
                for rid in list(self._streams):
                    self._deliver(rid, exc)
                    self.engine.abort_request(rid)
                continue
            self._deliver_step(outputs)
            for out in outputs:
                if out.finished:
                    self.engine.forget(out.request_id)


def _put_all(batch: list) -> None:
    for q, item in batch:
        q.put_nowait(item)
