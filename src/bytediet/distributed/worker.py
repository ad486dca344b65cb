"""A tensor-parallel worker process (ranks 1..N−1): load its shard, then run every step rank 0 broadcasts.

Rank 0 (the engine's process) schedules, samples and owns the block manager; a worker only mirrors the
forward pass on its shard, over its own KV pages (its heads only). Messages, in the order rank 0 sends
them over the control group: :class:`AllocateCaches` (again whenever the engine is rebuilt), one
:class:`Step` per engine step, a :class:`Call` when rank 0 runs a function on every shard (scoring a
sequence, a measurement), and finally :class:`Stop`. A worker that fails writes its traceback to the
store (``error/<rank>``) so rank 0 can quote it.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..models.placement import move_model, one_copy_on_gpu_path, rank_device
from .comm import TPGroup
from .shard import load_shard


@dataclass
class AllocateCaches:
    codec: Any  # the KVCodec object, calibration state included (pickled by the broadcast)
    num_blocks: int
    block_size: int


@dataclass
class Step:
    """One forward pass: the runner's flattened batch (CPU tensors) and the sequences freed since the last."""

    input_ids: torch.Tensor
    meta: Any  # AttentionMetadata
    logit_rows: torch.Tensor
    freed: list[int] = field(default_factory=list)


@dataclass
class Call:
    """Run ``fn(model, *args)`` on the shard while rank 0 runs it on its own (the collectives inside meet);
    with ``gather`` the result goes back to rank 0. ``fn`` travels pickled: a module-level function."""

    fn: Callable[..., Any]
    args: tuple = ()
    gather: bool = False


@dataclass
class Stop:
    pass


@dataclass
class WorkerArgs:
    rank: int
    world: int
    host: str
    port: int
    timeout_s: float
    threads: int
    load: dict  # load_shard's keyword arguments (spec, dtype, weights, keep_packed, activations)
    device: str = "cpu"  # the engine's device: "cuda" puts rank r on GPU r, its activations' collectives on NCCL


def worker_main(args: WorkerArgs) -> None:
    """The entry point of a spawned worker process."""
    store = dist.TCPStore(args.host, args.port, args.world, is_master=False, timeout=timedelta(seconds=args.timeout_s))
    try:
        torch.set_num_threads(args.threads)
        device = rank_device(args.device, args.rank)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)  # NCCL binds this rank to its own GPU
        store.set(f"alive/{args.rank}", str(os.getpid()))
        group = TPGroup.create(store, args.rank, args.world, device, args.timeout_s)
        model, _ = load_shard(group, **args.load)
        move_model(model, device)
        one_copy_on_gpu_path(model)  # the shard is only run here
        store.set(f"ready/{args.rank}", "1")
        serve(model, group)
    except BaseException:
        store.set(f"error/{args.rank}", traceback.format_exc()[-4000:])
        raise SystemExit(1) from None


@torch.inference_mode()
def serve(model, group: TPGroup) -> None:
    """Run rank 0's messages until :class:`Stop`."""
    caches: Optional[list] = None
    while True:
        msg = group.broadcast_object()
        if isinstance(msg, Stop):
            return
        if isinstance(msg, AllocateCaches):
            caches = None  # the old pages go before the new ones are allocated
            caches = model.new_caches(msg.num_blocks, msg.block_size, msg.codec)
            continue
        if isinstance(msg, Call):
            result = msg.fn(model, *msg.args)
            if msg.gather:
                group.gather_object(result)
            continue
        for seq_id in msg.freed:
            for cache in caches:
                cache.free_sequence(seq_id)
        device = model.device
        model(msg.input_ids.to(device), msg.meta.to(device), caches, msg.logit_rows.to(device))
