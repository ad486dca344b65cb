"""``evaluate`` at tensor-parallel size N: the reference and the test configuration each split across N
processes (:mod:`bytediet.distributed`), every rank loading only its own shard.

Each subject is an :class:`~bytediet.engine.llm.LLM` over its ranks, and every task runs through it
(:attr:`bytediet.eval.harness.Subject.llm`): perplexity scores each window with :meth:`LLM.score` — the
model's paged forward pass on every rank, the logits all-gathered, so the numbers are those of size 1 up
to the all-reduces' order of summation; passkey and speed rebuild the LLM's engine with the settings they
use at size 1 (:meth:`LLM.rebuild_engine`); speed sums weight bytes and memory over the ranks.

The reference is the checkpoint dequantized to float32 (``keep_packed=False``, as :func:`load_model` gives
it) with the model's own KV dtype. The test is the checkpoint loaded again with ``weights`` (each layer
quantized whole, then cut) or as the engine runs it (a GGUF's blocks packed); when that is the same model
(no ``weights``, no quantized blocks) the reference's ranks serve the test too, with its KV codec. Only
one of the two is loaded at a time. KV calibration (``kv_calibration``, an ``auto:<bits>`` budget's plan)
runs the whole model in one process, so it is refused here.
"""

from __future__ import annotations

import time
from typing import Optional

from ..errors import ConfigError
from .harness import (
    EvalSettings,
    ReferenceCache,
    Subject,
    build_context,
    check_weights,
    check_window,
    reference_cache,
    result_dict,
    run_tasks,
)


def evaluate_tensor_parallel(
    model_spec,
    size: int,
    *,
    settings: EvalSettings,
    weights: Optional[str] = None,
    kv_cache_dtype: Optional[str] = None,
    reference: Optional[ReferenceCache] = None,
    progress: bool = True,
    kv_calibration: Optional[dict] = None,
    device: str = "cpu",
) -> dict:
    """:func:`bytediet.eval.harness.evaluate` with both models split across ``size`` processes (on ``cuda``: a GPU
    each)."""
    from ..engine.llm import LLM
    from ..kvcache import get_kv_codec
    from ..models.loader import load_config, native_block_types, resolve_model_path

    kv = kv_cache_dtype or "auto"
    if kv_calibration or kv.strip().lower().startswith("auto:"):
        raise ConfigError(
            f"KV calibration of {kv} (--kv-calib-windows, an auto:<bits> budget's plan) runs the whole "
            f"model in one process, not at --tensor-parallel-size {size}: evaluate the codec "
            "uncalibrated (no --kv-calib-windows), or use --tensor-parallel-size 1"
        )
    label = str(model_spec)
    reference = reference_cache(label, settings, reference)
    config = load_config(model_spec)
    kv_name = get_kv_codec(kv).describe(config.head_dim)  # fails early on an unknown codec
    if weights:
        check_weights(weights)
    t0 = time.perf_counter()
    llm = LLM(  # the tasks size their own pools
        label, dtype="float32", keep_packed=False, num_blocks=1, tensor_parallel_size=size, device=device
    )
    try:
        check_window(settings, config, llm.tokenizer is not None)
        ctx = build_context(llm.tokenizer, settings, reference, progress=progress)
        # the GGUF blocks the engine runs packed (as load_as_engine_runs: none in a directory); none: one model
        blocks = {} if resolve_model_path(model_spec).is_dir() else native_block_types(llm.model)
        model = llm.model

        def make_test() -> Subject:
            nonlocal llm
            if weights or blocks:  # another model: the reference's ranks stop first
                llm.shutdown()
                llm = LLM(
                    label,
                    dtype="float32",
                    weights=weights,
                    keep_packed=True,
                    num_blocks=1,
                    tensor_parallel_size=size,
                    device=device,
                )
            return Subject("test", llm.model, llm.tokenizer, kv, weights, llm=llm)

        results = run_tasks(Subject("reference", model, llm.tokenizer, "auto", None, llm=llm), make_test, ctx)
    finally:
        llm.shutdown()
    out = result_dict(label, model, ctx, results, weights, kv, kv_name, blocks if not weights else {}, t0)
    out["config"]["kv_calibration"] = None
    out["tensor_parallel_size"] = size
    return out
