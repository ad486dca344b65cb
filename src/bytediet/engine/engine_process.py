"""``EngineProcess``: the engine core in a process of its own, streams as async iterators (for the server).

The API process keeps the event loop (HTTP, JSON, SSE, tokenization, chat templates); the engine process owns
the model, the scheduler, sampling, detokenization and stop strings, so neither steals the other's GIL (vLLM v1's
AsyncLLM / EngineCore split). They talk over one pipe: the API side sends ``add`` / ``abort`` / ``stop`` from a
sender thread (a big prompt never blocks the event loop), the engine sends each step's outputs in one message
with its counters, and a reader thread hands them to the requests' ``asyncio.Queue``\\ s, once per step.
The engine process ignores SIGINT / SIGTERM (the API process drains, then stops it) and exits when the pipe
closes, so it never outlives the server. Grammar masks cross the pipe as their schema and are compiled there.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import pickle
import queue
import signal
import threading
import traceback
from dataclasses import replace
from typing import AsyncIterator, Callable, Optional, Sequence

from ..errors import ConfigError
from .engine import StepOutput
from .grammar import GrammarMask
from .params import SamplingParams
from .snapshot import EngineCounters, EngineInfo, engine_counters, engine_info


class EngineDied(RuntimeError):
    """The engine process ended while requests were in flight."""


class EngineProcess:
    """``AsyncEngine``'s interface over an engine built by ``factory(*args)`` in a spawned process.

    ``factory`` must be importable by name (a module-level function) and return an ``LLM`` or an ``LLMEngine``;
    it runs in the new process, so the model is loaded there. Raises ``ConfigError`` / ``RuntimeError`` with the
    child's message when building the engine fails.
    """

    def __init__(self, factory: Callable, *args, start_timeout: float = 3600.0) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that runs OpenMP / native thread pools
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_main, args=(child, factory, args), name="bytediet-engine-core")
        self._proc.start()  # not a daemon: a tensor-parallel engine starts worker processes of its own
        child.close()
        self.info, self._counters = self._wait_ready(start_timeout)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._outbox: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._dead: Optional[str] = None
        self._reader = threading.Thread(target=self._read, name="bytediet-engine-reader", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="bytediet-engine-sender", daemon=True)
        self._reader.start()
        self._sender.start()

    def _wait_ready(self, timeout: float) -> tuple[EngineInfo, EngineCounters]:
        waited = 0.0
        while not self._conn.poll(1.0):
            waited += 1.0
            if not self._proc.is_alive() or waited >= timeout:
                self._proc.kill()
                raise RuntimeError(
                    f"the engine process did not start (exit status {self._proc.exitcode}); "
                    "run with --no-engine-process to see the error in this process"
                )
        msg = self._conn.recv()
        if msg[0] == "failed":
            self._proc.join(timeout=30)
            raise msg[1]
        return msg[1], msg[2]

    # -- public API (event-loop side), as AsyncEngine's ----------------------------------------------
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: Optional[str] = None,
        priority: int = 0,
    ) -> AsyncIterator[StepOutput]:
        """Validate, queue and stream one request; raises ``ConfigError`` before queueing on bad input."""
        ids = self.info.validate(prompt_token_ids, params)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ConfigError(f"priority: must be an integer, got {priority!r}")
        if self._dead is not None:
            raise EngineDied(self._dead)
        rid = request_id or f"async-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (loop, outputs)
        self._outbox.put(("add", rid, ids, _portable(params), priority))
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
        self._outbox.put(("abort", request_id))

    def shutdown(self) -> None:
        """Stop the engine process (its tensor-parallel workers with it); waits up to 30 s, then kills it."""
        if self._proc.is_alive():
            self._outbox.put(("stop",))
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=5)
        self._reader.join(timeout=5)  # the engine's last counters (the server logs its blocks in use)
        self._outbox.put(None)
        self._conn.close()

    @property
    def is_alive(self) -> bool:
        """True while the engine process runs and answers (the server's health check)."""
        return self._dead is None and self._proc.is_alive()

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid

    def counters(self) -> EngineCounters:
        """The engine's state after its last step."""
        return self._counters

    @property
    def failure(self) -> Optional[str]:
        return self._counters.failure

    @property
    def num_running(self) -> int:
        return self._counters.num_running

    @property
    def num_waiting(self) -> int:
        return self._counters.num_waiting

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        return self.info.validate(prompt_token_ids, params)

    # -- the two pipe threads -------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while (cmd := self._outbox.get()) is not None:
            try:
                self._conn.send(cmd)
            except (OSError, ValueError):  # the engine process is gone: the reader reports it
                return
            except Exception as exc:  # e.g. an unpicklable logits processor: fail that request only
                if cmd[0] == "add":
                    self._deliver(
                        [
                            (
                                cmd[1],
                                RuntimeError(
                                    f"cannot send the request to the engine process: {exc}; "
                                    "use picklable logits processors or --no-engine-process"
                                ),
                            )
                        ]
                    )

    def _read(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "out":
                    self._counters = msg[2]
                    self._deliver([(out.request_id, out) for out in msg[1]])
                elif msg[0] == "error":  # one request failed (a bad add, or a step that raised)
                    self._counters = msg[2]
                    self._deliver(msg[1])
                elif msg[0] == "counters":
                    self._counters = msg[1]
        except (EOFError, OSError):
            pass
        self._proc.join(timeout=1)  # for its exit status
        self._dead = f"the engine process has stopped (exit status {self._proc.exitcode}); restart the server"
        self._deliver([(rid, EngineDied(self._dead)) for rid in list(self._streams)])

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """Hand items to their streams: one ``call_soon_threadsafe`` per event loop, not per item."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, item in items:
            target = self._streams.get(rid)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that loop has closed: its requests are gone
                pass


def _put_all(batch: list) -> None:
    for q, item in batch:
        q.put_nowait(item)


class _GrammarSpec:
    """A grammar mask as it crosses the pipe: its schema text, compiled in the engine process."""

    def __init__(self, schema_text: Optional[str]) -> None:
        self.schema_text = schema_text

    def __call__(self, output_ids, logits):  # a logits processor in form only: _Core.local replaces it
        raise RuntimeError("a grammar spec was used as a mask before the engine process compiled it")


def _portable(params: SamplingParams) -> SamplingParams:
    """``params`` with grammar masks replaced by their schema (masks hold native matcher state)."""
    procs = params.logits_processors
    if not procs or not any(isinstance(p, GrammarMask) for p in procs):
        return params
    return replace(
        params, logits_processors=tuple(_GrammarSpec(p.schema_text) if isinstance(p, GrammarMask) else p for p in procs)
    )


# -- the engine process ------------------------------------------------------------------------------------
def _engine_main(conn, factory: Callable, args: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C reaches the whole process group: the API process drains
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # and stops this process itself when it is done
    try:
        built = factory(*args)
        engine = getattr(built, "engine", built)
        conn.send(("ready", engine_info(engine), engine_counters(engine)))
    except BaseException as exc:
        conn.send(("failed", _picklable(exc)))
        return
    try:
        _Core(engine, conn).run()
    except (EOFError, OSError):  # the API process is gone (a broken pipe): nothing is left to serve
        pass
    finally:
        if hasattr(built, "shutdown"):
            built.shutdown()


class _Core:
    """The engine loop: take commands, step, send each step's outputs in one message."""

    def __init__(self, engine, conn) -> None:
        self.engine, self.conn = engine, conn
        self.requests: set[str] = set()
        self.compiler = None  # the grammar compiler, built on the first structured-output request
        self.sent: Optional[EngineCounters] = None  # the counters last sent while idle

    def run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            if self.conn.poll(0 if busy else 0.5) and not self.take_commands():
                return
            if not engine.has_unfinished_requests():  # idle: the counters still change (aborts, a worker dying)
                counters = engine_counters(engine)
                if counters != self.sent:
                    self.conn.send(("counters", counters))
                    self.sent = counters
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug, not bad input: fail the requests in flight, keep serving
                failed = _picklable(exc)
                for rid in self.requests:
                    engine.abort_request(rid)
                    engine.forget(rid)
                self.conn.send(("error", [(rid, failed) for rid in self.requests], engine_counters(engine)))
                self.requests.clear()
                continue
            for out in outputs:
                if out.finished:
                    engine.forget(out.request_id)
                    self.requests.discard(out.request_id)
            self.conn.send(("out", outputs, engine_counters(engine)))

    def take_commands(self) -> bool:
        """Apply every command waiting on the pipe; False on ``stop``."""
        errors = []
        while self.conn.poll(0):
            cmd = self.conn.recv()
            if cmd[0] == "stop":  # the last counters first: the server logs the KV blocks still in use
                self.conn.send(("counters", engine_counters(self.engine)))
                return False
            if cmd[0] == "add":
                _, rid, ids, params, priority = cmd
                try:
                    self.engine.add_request(ids, self.local(params), request_id=rid, priority=priority)
                    self.requests.add(rid)
                except Exception as exc:  # e.g. a duplicate id: report to that stream only
                    errors.append((rid, _picklable(exc)))
            elif cmd[0] == "abort":
                self.engine.abort_request(cmd[1])
                self.engine.forget(cmd[1])
                self.requests.discard(cmd[1])
        if errors:
            self.conn.send(("error", errors, engine_counters(self.engine)))
        return True

    def local(self, params: SamplingParams) -> SamplingParams:
        """``params`` with each grammar spec compiled into a fresh mask here."""
        procs = params.logits_processors
        if not procs or not any(isinstance(p, _GrammarSpec) for p in procs):
            return params
        if self.compiler is None:
            from .grammar import GrammarCompiler

            self.compiler = GrammarCompiler(self.engine.tokenizer, self.engine.model.config.vocab_size)
        return replace(
            params,
            logits_processors=tuple(
                GrammarMask(self.compiler.compile_json(p.schema_text), self.compiler.vocab_size, p.schema_text)
                if isinstance(p, _GrammarSpec)
                else p
                for p in procs
            ),
        )


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` itself when it crosses the pipe, else a RuntimeError carrying its text."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")
