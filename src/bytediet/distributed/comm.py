"""The tensor-parallel process groups and the three collectives the sharded model uses.

Each engine owns its own groups, built from a ``torch.distributed`` store (no default process group,
so several engines may live in one process one after the other): a *data* group for the model's
all-reduces and all-gathers — NCCL when the model is on CUDA, gloo on the CPU — and a *control* group,
always gloo, over which rank 0 broadcasts each step's batch as a pickled object and gathers the ranks'
answers to a :class:`~.worker.Call` (vLLM keeps the same split: a CPU group for metadata, a device group
for activations).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist


def backend_for(device: torch.device | str) -> str:
    """The data-plane backend for a model on ``device``: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _process_group(backend: str, store, rank: int, world: int, timeout: timedelta):
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


@dataclass
class TPGroup:
    """One rank's view of a tensor-parallel group of ``world`` processes."""

    rank: int
    world: int
    data: Any  # the process group of activations (gloo or NCCL)
    control: Any  # gloo, for pickled step metadata

    @classmethod
    def create(cls, store, rank: int, world: int, device: torch.device | str, timeout_s: float) -> "TPGroup":
        """Join the groups under ``store`` (every rank calls this; it returns when all have joined)."""
        timeout = timedelta(seconds=timeout_s)
        data = _process_group(backend_for(device), dist.PrefixStore("data/", store), rank, world, timeout)
        control = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, world, timeout)
        return cls(rank, world, data, control)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        self.data.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's ``x`` (..., sizes[rank]) along the last dimension → (..., sum(sizes)).

        The collective needs equal shapes, so each piece is padded to the largest size and trimmed after.
        """
        width = max(sizes)
        piece = x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        outs = [torch.empty_like(piece) for _ in range(self.world)]
        self.data.allgather([outs], [piece.contiguous()]).wait()
        return torch.cat([o[..., :n] for o, n in zip(outs, sizes)], dim=-1)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (a length, then the pickled bytes, over the control group)."""
        if self.rank == 0:
            payload = torch.frombuffer(
                bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8
            )
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast([size], dist.BroadcastOptions()).wait()
        if self.rank != 0:
            payload = torch.empty(int(size), dtype=torch.uint8)
        self.control.broadcast([payload], dist.BroadcastOptions()).wait()
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def gather_object(self, obj: Any) -> Optional[list]:
        """Every rank's ``obj`` on rank 0, in rank order (None on the others): each rank's length, then the
        pickled bytes padded to the longest, over the control group (all ranks call it)."""
        mine = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self.control.allgather([sizes], [torch.tensor([mine.numel()], dtype=torch.int64)]).wait()
        width = max(int(n) for n in sizes)
        payloads = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world)]
        self.control.allgather([payloads], [torch.nn.functional.pad(mine, (0, width - mine.numel()))]).wait()
        if self.rank != 0:
            return None
        return [pickle.loads(p[: int(n)].numpy().tobytes()) for p, n in zip(payloads, sizes)]
