"""The memory plans of ``eval``, ``quantize`` and ``serve``: each command's peak predicted from the checkpoint's
header and its options (:mod:`bytediet.perf.memory`), printed, and checked before anything is loaded.

* ``eval``: the reference loaded in float32 beside the test model (the checkpoint as the engine runs it, or the
  reference quantized in place: its packed layers beside the float ones while they are made), the reference
  logits kept in RAM (up to the cache's limit), and a window's scoring (a chunk of logits, ``lm_head`` decoded);
* ``eval --kv-pareto``: one model (float32, or quantized in place to ``--weights``), the bf16 KV reference logits
  in RAM up to the cache's limit (the other windows in one file each), a window's scoring, the K/V/Q the KV
  calibration captures, and the passkey engine's KV;
* ``quantize``: the float32 load, the packed result of every layer (installed only when all are made), and the
  larger of quantizing one layer and calibrating one block;
* ``serve``: the model as the engine loads it (its blocks, or ``--weights`` with native copies), the KV pool
  (``--kv-cache-memory``) and one step's activations and logits.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from ..config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from ..perf.memory import GB, RUNTIME_BYTES, Footprint, MemoryPlan, footprint

STEP_FLOATS_PER_TOKEN = 16  # hidden-sized float32 activations one engine step holds per token (q, k, v, MLP, …)


def _base(fp: Footprint) -> dict[str, int]:
    return {"runtime": RUNTIME_BYTES, "tokenizer": fp.tokenizer_bytes}


def plan_eval(model: str, weights: Optional[str] = None, windows: int = 8, window_len: int = 512) -> MemoryPlan:
    """The predicted peak of ``bytediet eval --model model [--weights W] --windows N --window-len L``."""
    from ..eval.harness import REFERENCE_RAM_BYTES
    from ..optimize.memory_plan import candidate_bytes, measuring_bytes, quantizing_bytes

    fp = footprint(model)
    c = fp.config
    if weights:  # the reference quantized in place: its packed layers (and native copies) beside the floats
        test = candidate_bytes(fp, weights) + quantizing_bytes(fp, weights)
    else:  # the checkpoint as the engine runs it, loaded a second time
        test = fp.loaded_bytes
    logits = windows * window_len * c.vocab_size * 4
    parts = {
        **_base(fp),
        "reference model (float32)": fp.float_bytes,
        f"test model ({weights or 'as loaded'})": test,
        "reference logits": min(logits, REFERENCE_RAM_BYTES) + window_len * c.vocab_size * 4,
        "scoring (or loading)": max(measuring_bytes(fp), fp.loading_bytes),  # logit chunks, lm_head decoded
    }
    plan = MemoryPlan("bytediet eval", parts)
    if logits > window_len * c.vocab_size * 4:
        plan.smaller.append(f"fewer windows: --windows {max(windows // 2, 1)}")
    plan.smaller.append(f"a shorter window: --window-len {max(window_len // 2, 64)}")
    return plan


def plan_kv_pareto(
    model: str,
    weights: Optional[str] = None,
    windows: int = 4,
    window_len: int = 2048,
    calib_windows: int = 1,
    calib_len: int = 512,
    passkey_lengths: Sequence[int] = (),
) -> MemoryPlan:
    """The predicted peak of ``bytediet eval --kv-pareto`` with these options (lengths beyond the context are
    skipped, as the report skips them)."""
    from ..eval.harness import REFERENCE_RAM_BYTES
    from ..optimize.memory_plan import candidate_bytes, measuring_bytes, quantizing_bytes

    fp = footprint(model)
    c = fp.config
    model_bytes = fp.float_bytes
    if weights:  # loaded in float32 and quantized in place: the packed layers beside the floats while they are made
        model_bytes += candidate_bytes(fp, weights, repacked=False) + quantizing_bytes(fp, weights)
    window = max(window_len - 1, 1) * c.vocab_size * 4  # a window's reference logits (its first token is not predicted)
    captured = calib_windows * calib_len * c.num_layers * (2 * c.num_kv_heads + c.num_heads) * c.head_dim
    bf16_token = 2 * c.num_kv_heads * c.head_dim * 2 * c.num_layers
    passkey_len = max((n for n in passkey_lengths if n <= c.max_position_embeddings), default=0)
    parts = {
        **_base(fp),
        f"model ({weights or 'float32'})": model_bytes,
        "reference logits": min(windows, REFERENCE_RAM_BYTES // window) * window,  # in RAM: whole windows that fit
        "scoring (or loading)": max(measuring_bytes(fp), fp.loading_bytes),  # logit chunks, lm_head decoded
        "KV calibration (captured K, V, Q)": captured * 4,
        "passkey engine KV (bf16)": bf16_token * (passkey_len + 64) if passkey_len else 0,
    }
    plan = MemoryPlan("bytediet eval --kv-pareto", parts)
    if calib_windows > 1:
        plan.smaller.append(f"fewer calibration windows: --kv-calib-windows {calib_windows // 2}")
    plan.smaller.append(f"a shorter window: --window-len {max(window_len // 2, 64)}")
    return plan


def plan_quantize(
    model: str,
    fmt: str,
    calibrate: Optional[str] = None,
    calib_samples: int = 128,
    calib_len: int = 512,
    overrides: Optional[dict] = None,
) -> MemoryPlan:
    """The predicted peak of ``bytediet quantize --model model --format fmt [--calibrate M]``."""
    from ..optimize.memory_plan import calibration_bytes, candidate_bytes, quantizing_bytes

    fp = footprint(model)
    spec = fmt if not calibrate else f"{fmt}+{calibrate}"
    packed = candidate_bytes(fp, fmt, tuple((overrides or {}).items()), repacked=False)
    building = quantizing_bytes(fp, fmt)
    if calibrate:
        building = max(building, calibration_bytes(fp, calibrate, calib_samples, calib_len))
    plan = MemoryPlan(
        "bytediet quantize",
        {
            **_base(fp),
            "model (float32)": fp.float_bytes,
            f"packed {spec}": packed,
            "building": max(building, fp.loading_bytes),
        },
    )
    if calibrate:
        plan.smaller.append(f"fewer calibration windows: --calib-samples {max(calib_samples // 2, 1)}")
        plan.smaller.append(f"a shorter calibration window: --calib-len {max(calib_len // 2, 64)}")
    plan.smaller.append("nothing smaller holds the float32 load: quantize on a machine with more memory")
    return plan


def plan_serve(
    model: str,
    weights: Optional[str] = None,
    kv_cache_memory=None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: int = 64,
) -> MemoryPlan:
    """The predicted peak of ``bytediet serve`` (and ``generate``/``chat``: one engine) with these options."""
    from ..config import parse_bytes
    from ..engine.llm import DEFAULT_KV_MEMORY
    from ..optimize.memory_plan import candidate_bytes, quantizing_bytes

    fp = footprint(model)
    c = fp.config
    if weights:  # loaded in float32 and quantized in place; later the packed layers with their native copies
        loading = fp.float_bytes + candidate_bytes(fp, weights, repacked=False) + quantizing_bytes(fp, weights)
        running = candidate_bytes(fp, weights) + c.vocab_size * c.hidden_size * 4 + fp.norm_bytes
        weights_bytes = max(loading, running)
    else:
        weights_bytes = fp.loaded_bytes
    kv = parse_bytes(kv_cache_memory or DEFAULT_KV_MEMORY)
    step = max_num_batched_tokens * (STEP_FLOATS_PER_TOKEN * c.hidden_size + 2 * c.intermediate_size) * 4
    step += max_num_seqs * c.vocab_size * 4  # a step's logits: one row per running sequence
    step += c.vocab_size * c.hidden_size * 4  # lm_head decoded for a prefill
    plan = MemoryPlan(
        "bytediet serve",
        {
            **_base(fp),
            f"model ({weights or 'as loaded'})": weights_bytes + (fp.x4_bytes if not weights else 0),  # + x4 copies
            "KV cache": kv,
            "engine step (or loading)": max(step, fp.loading_bytes),
        },
    )
    plan.smaller.append(f"a smaller KV cache: --kv-cache-memory {max(kv // 2 >> 20, 64)}MiB")
    plan.smaller.append(f"a smaller step: --max-num-batched-tokens {max(max_num_batched_tokens // 2, 16)}")
    return plan


def announce(plan: MemoryPlan, quiet: bool = False) -> MemoryPlan:
    """Print ``plan`` on stderr (unless ``quiet``) and refuse, in one line, a machine that cannot hold it."""
    if not quiet:
        print(plan.describe(), file=sys.stderr, flush=True)
    plan.check()
    return plan


__all__ = ["GB", "announce", "plan_eval", "plan_kv_pareto", "plan_quantize", "plan_serve"]
