"""Rank 0's handle on its tensor-parallel workers: spawn them, load the shards, feed them each step,
and turn a dead or silent worker into an error that names its rank.

The engine process is rank 0: it keeps the scheduler, the block manager and the sampler, loads its own
shard, and before each forward pass broadcasts the batch (:class:`~.worker.Step`) to ranks 1..N−1,
spawned here with ``torch.multiprocessing`` (the ``spawn`` start method). Every collective waits at
most ``timeout_s``; a worker killed mid-step closes its sockets, so rank 0's next collective fails at
once and :meth:`Workers.failure` reports which rank died and how.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import BytedietError, ConfigError
from ..models.placement import rank_device
from .comm import TPGroup
from .shard import load_shard
from .worker import AllocateCaches, Call, Step, Stop, WorkerArgs, worker_main

HOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 60.0  # longest a step's collective may wait for a worker before the engine fails
LOAD_TIMEOUT_S = 900.0  # longest the workers may take to start and load their shards


class TensorParallelError(BytedietError):
    """A tensor-parallel worker died, hung or failed; the engine cannot continue."""


def default_threads(world: int) -> int:
    """torch threads per rank: the machine's cores shared out (two 2-thread ranks on 2 cores would thrash)."""
    return max(1, (os.cpu_count() or 1) // world)


class Workers:
    """Ranks 1..N−1 as seen from rank 0 (which holds the group's rank-0 end)."""

    def __init__(self, group: TPGroup, store, procs: list) -> None:
        self.group, self.store, self.procs = group, store, procs
        self._freed: list[int] = []
        self.failed: Optional[str] = None  # the first failure's message; every later call re-raises it

    @property
    def world(self) -> int:
        return self.group.world

    # -- messages ---------------------------------------------------------------------------------
    def allocate(self, codec, num_blocks: int, block_size: int) -> None:
        """Have every worker allocate the same number of KV blocks with the same codec (its heads only), in place
        of its old pages (a rebuilt engine): sequences freed in those need no message."""
        self._freed = []
        self._call(lambda: self.group.broadcast_object(AllocateCaches(codec, num_blocks, block_size)))

    def free_sequence(self, seq_id: int) -> None:
        """Forget a sequence's per-sequence codec state on the workers too (sent with the next step)."""
        self._freed.append(seq_id)

    def run(
        self, input_ids: torch.Tensor, meta, logit_rows: torch.Tensor, forward: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """Broadcast one step, then run rank 0's own ``forward`` (its collectives meet the workers')."""
        step = Step(input_ids.cpu(), meta.to("cpu"), logit_rows.cpu(), self._freed)
        self._freed = []
        return self._call(lambda: (self.group.broadcast_object(step), forward())[1])

    def call(self, fn: Callable[..., Any], args: tuple, local: Callable[[], Any], gather: bool = False) -> list:
        """Have every worker run ``fn(shard, *args)`` while rank 0 runs ``local()`` (the same function on its own
        shard: collectives inside meet). Returns ``[rank 0's result]``, or with ``gather`` every rank's, in rank
        order (each pickled back: keep them small)."""

        def run() -> list:
            self.group.broadcast_object(Call(fn, tuple(args), gather))
            mine = local()
            return self.group.gather_object(mine) if gather else [mine]

        return self._call(run)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (politely if they still answer) and wait for them to exit."""
        if self.failed is None and any(p.is_alive() for p in self.procs):
            try:
                self.group.broadcast_object(Stop())
            except Exception:  # a worker already gone; it is terminated below
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(1.0)
        self.failed = self.failed or "the tensor-parallel workers were shut down"

    # -- failures ---------------------------------------------------------------------------------
    def problem(self) -> Optional[str]:
        """None while every worker runs; else what went wrong (for ``/health``; a step also raises it)."""
        if self.failed is not None:
            return self.failed
        dead = [
            f"rank {r} (pid {p.pid}) {_exit_text(p.exitcode)}{_stored_error(self.store, r)}"
            for r, p in enumerate(self.procs, start=1)
            if not p.is_alive()
        ]
        return "tensor-parallel worker " + "; ".join(dead) if dead else None

    def _call(self, fn):
        if self.failed is not None:
            raise TensorParallelError(self.failed)
        try:
            return fn()
        except RuntimeError as exc:  # gloo / NCCL: a peer closed its connection or a wait timed out
            self.failed = self.failure(exc)
            self.terminate()
            raise TensorParallelError(self.failed) from exc

    def failure(self, exc: Optional[BaseException] = None, grace_s: float = 2.0) -> str:
        """A message naming the ranks that died (exit code, their traceback's last line) or went silent."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and all(p.is_alive() for p in self.procs):
            time.sleep(0.05)  # a killed worker's exit shows a moment after its sockets close
        dead = [
            f"rank {r} (pid {p.pid}) {_exit_text(p.exitcode)}{_stored_error(self.store, r)}"
            for r, p in enumerate(self.procs, start=1)
            if not p.is_alive()
        ]
        if dead:
            return "tensor-parallel worker " + "; ".join(dead) + "; the engine cannot continue — restart it"
        silent = ", ".join(str(r) for r in range(1, self.world))
        return (
            f"tensor-parallel worker rank(s) {silent} did not answer within the collective timeout "
            f"({exc}); a worker hangs or the machine is overloaded — restart the engine"
        )

    def terminate(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()


def _exit_text(code: Optional[int]) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _stored_error(store, rank: int) -> str:
    try:
        if store.check([f"error/{rank}"]):
            text = store.get(f"error/{rank}").decode(errors="replace").strip().splitlines()
            return f": {text[-1]}" if text else ""
    except Exception:  # the store itself is gone; the exit code is all there is
        pass
    return ""


def launch(
    world: int, load: dict, threads: Optional[int] = None, timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cpu"
):
    """Spawn ranks 1..world−1, load rank 0's shard here → ``(workers, model, tokenizer)``.

    ``load``: :func:`~.shard.load_shard`'s arguments (``spec``, ``dtype``, ``weights``, ``keep_packed``,
    ``activations``); every rank reads only its own slices of the checkpoint, all at the same time. ``device``
    ``cuda``: rank r computes on GPU r (each worker moves its shard there; rank 0's caller moves its own), and
    the activations' all-reduces and all-gathers run over NCCL.
    """
    if world < 2:
        raise ConfigError(f"tensor_parallel_size {world}: launch needs at least 2 ranks")
    threads = threads or default_threads(world)
    torch.set_num_threads(threads)
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(rank_device(device, 0))  # rank 0 on GPU 0, each worker on its own
    store = dist.TCPStore(
        HOST, 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=LOAD_TIMEOUT_S)
    )
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=worker_main,
            name=f"bytediet-tp-rank{r}",
            daemon=True,
            args=(WorkerArgs(r, world, HOST, store.port, timeout_s, threads, load, device),),
        )
        for r in range(1, world)
    ]
    for p in procs:
        p.start()
    handle = None
    try:
        _wait_for(store, procs, "alive", "start")
        group = TPGroup.create(store, 0, world, rank_device(device, 0), timeout_s)
        handle = Workers(group, store, procs)
        model, tokenizer = load_shard(group, load_tokenizer=True, **load)
        _wait_for(store, procs, "ready", "load its shard")
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.terminate()
        raise
    return handle, model, tokenizer


def _wait_for(store, procs: list, key: str, what: str) -> None:
    """Poll until every worker has set ``<key>/<rank>``; a worker that exits first fails the launch at once."""
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    pending = set(range(1, len(procs) + 1))
    while pending:
        pending = {r for r in pending if not store.check([f"{key}/{r}"])}
        for r in sorted(pending):
            p = procs[r - 1]
            if not p.is_alive():
                raise TensorParallelError(
                    f"tensor-parallel worker rank {r} (pid {p.pid}) {_exit_text(p.exitcode)} "
                    f"before it could {what}{_stored_error(store, r)}"
                )
        if pending and time.monotonic() > deadline:
            raise TensorParallelError(
                f"tensor-parallel worker rank(s) {sorted(pending)} did not {what} within {LOAD_TIMEOUT_S:.0f} s"
            )
        time.sleep(0.05)
