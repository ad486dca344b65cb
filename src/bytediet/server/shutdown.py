"""Graceful shutdown: on SIGTERM/SIGINT stop taking requests, let running ones finish, then abort the rest.

:class:`Drain` tracks the API requests in flight (each one's output queue, see ``serving.run_jobs``);
:class:`GracefulServer` is uvicorn's server with its signal handling replaced:

1. the first SIGTERM or SIGINT starts draining: every new request gets 503 (``middleware.Draining``);
2. running requests have ``shutdown_timeout`` seconds to finish;
3. the rest are aborted: each stream gets a final error event and ``[DONE]``, each waiting
   non-streamed request a 503 error object, and their KV blocks are freed;
4. uvicorn then closes the sockets, the app's lifespan stops the engine and the process exits 0
   (uvicorn's own handler re-raises the signal, so the exit status was -15, or a traceback on ^C).

A second signal skips the rest of the wait (step 3 at once); the exit is just as clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from typing import Optional

import uvicorn

from .errors import APIError

log = logging.getLogger("bytediet.server")
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class ShuttingDown(APIError):
    """Delivered to every request still running when the shutdown timeout ends."""

    def __init__(self) -> None:
        super().__init__(
            503,
            "the server shut down before this request finished; retry it on another replica",
            type="server_error",
            code="shutting_down",
        )


class Drain:
    """The requests in flight, and the shutdown sequence over them."""

    ABORT_GRACE = 2.0  # seconds for aborted requests to send their last bytes

    def __init__(self) -> None:
        self.draining = False
        self.aborting = False
        self._active: dict[int, asyncio.Queue] = {}
        self._skip_wait: Optional[asyncio.Event] = None  # made on the event loop, in drain()

    # -- per request (serving.run_jobs) ---------------------------------------------------------
    def register(self, outputs: asyncio.Queue) -> None:
        """Track one request's output queue; raises :class:`ShuttingDown` once aborting has begun."""
        if self.aborting:
            raise ShuttingDown()
        self._active[id(outputs)] = outputs

    def unregister(self, outputs: asyncio.Queue) -> None:
        self._active.pop(id(outputs), None)

    @property
    def num_active(self) -> int:
        return len(self._active)

    # -- the shutdown sequence --------------------------------------------------------------------
    def abort_all(self) -> None:
        """Fail every request in flight with :class:`ShuttingDown` (each run_jobs raises it and aborts)."""
        self.aborting = True
        for outputs in list(self._active.values()):
            outputs.put_nowait((-1, ShuttingDown()))

    def skip_wait(self) -> None:
        if self._skip_wait is not None:
            self._skip_wait.set()

    async def drain(self, timeout: float) -> None:
        """Stop new requests, wait up to ``timeout`` s for the running ones, abort what is left."""
        self.draining = True
        self._skip_wait = asyncio.Event()
        t0 = time.monotonic()
        log.info("shutting down: %d request(s) running, waiting up to %.0f s for them", self.num_active, timeout)
        while self._active and time.monotonic() - t0 < timeout and not self._skip_wait.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._skip_wait.wait(), 0.05)
        if self._active:
            log.warning("shutting down: aborting %d request(s) still running", self.num_active)
        self.abort_all()
        t1 = time.monotonic()
        while self._active and time.monotonic() - t1 < self.ABORT_GRACE:
            await asyncio.sleep(0.02)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, draining through :class:`Drain` on SIGTERM/SIGINT and exiting normally after."""

    def __init__(self, config: uvicorn.Config, drain: Drain, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.drain, self.shutdown_timeout = drain, shutdown_timeout
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._draining_task: Optional[asyncio.Task] = None
        self.signals: list[int] = []

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """Our handler for SIGINT/SIGTERM, restored afterwards; unlike uvicorn's, the signal is not re-raised."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        self.signals.append(sig)
        if self._loop is None:  # before the loop runs: nothing to drain
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._on_signal)

    def _on_signal(self) -> None:
        if self._draining_task is None:
            self._draining_task = asyncio.ensure_future(self._drain_then_exit())
        else:  # a second signal: abort what runs now
            self.drain.skip_wait()

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.drain(self.shutdown_timeout)
        finally:
            self.should_exit = True
