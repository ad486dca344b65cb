"""Tensor parallelism on ``torch.distributed``: one model split across processes (gloo on CPU, NCCL on CUDA).

``partition`` (which slices a rank holds) → ``shard`` (cut while loading, wire the collectives) →
``comm`` (the process groups) → ``worker`` (ranks 1..N−1) → ``launch`` (rank 0's handle, used by the engine).
"""
