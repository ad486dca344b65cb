"""The peak memory of an ``optimize`` run, predicted from the checkpoint's header and the options.

Resident for the whole run: the runtime, the tokenizer, and the checkpoint as the engine runs it (its blocks, the
token embedding's too: :meth:`.recipe.Recipe._load`). Beside it, the larger of loading (the GGUF reader's metadata
views, for a moment) and the largest step:

* the checkpoint as loaded, measured (profile, baseline, its KV codecs and activation precisions): the native decode
  step's x4 copies of its blocks and the measuring below;
* a weight candidate (:meth:`.recipe.Recipe.build`): its packed layers once (kept only as the native kernels multiply
  them, :func:`~bytediet.models.share.native_only`; a layer its format leaves as it is shares the loaded blocks) —
  the x4 copies are let go meanwhile — and the larger of what building it and measuring it need:

  * building: a run of rows of one layer dequantized to float32 while it is quantized (the whole layer for formats
    whose rows do not pack independently) and the largest layer's repacked copy; a calibrated candidate holds one
    block's float weights, the hidden states of its windows and — GPTQ, Wanda, SparseGPT — a float64 Gram matrix
    per layer of the block (in² × 8 bytes each), with one more of the largest while it is factorised in place;
  * measuring: a chunk of a window's test logits and the same rows of its reference read back (at most
    :data:`~bytediet.eval.tasks.ROW_CHUNK_ELEMENTS` float32 each), the float64 comparison of a few rows, and a run
    of ``lm_head``'s rows decoded for a prefill (at most :data:`~bytediet.kernels.ops.DECODE_CHUNK_BYTES`).

While the model is loaded and a rounded candidate is built, its tensors get their own mappings
(:func:`~bytediet.perf.memory.lean_heap`), so a dropped candidate gives its layers back and the steps' peaks do not
add up. Beside the largest step, the heap's working set while a model is measured
(:data:`~bytediet.perf.memory.MEASURING_HEAP_BYTES`, a measured constant: bench/OPTIMIZE_MEMORY.md, session 15).
Where the machine cannot hold it, :func:`fit_to_memory` leaves out the calibration
methods whose step is largest.
"""

from __future__ import annotations

from dataclasses import replace

from ..eval.fidelity import COMPARE_CHUNK_ELEMENTS
from ..eval.tasks import ROW_CHUNK_ELEMENTS
from ..perf.memory import MEASURING_HEAP_BYTES, RUNTIME_BYTES, Footprint, MemoryPlan, footprint

FLOAT_COPIES_WHILE_QUANTIZING = 3  # the float weight, its scaled / rounded working copy, and the packed result
COMPARE_CHUNK_BYTES = 6 * COMPARE_CHUNK_ELEMENTS * 8  # fidelity's float64 log-softmax chunks, ref and test
GRAM_METHODS = ("gptq", "wanda", "sparsegpt")  # capture(hessian=True)


def candidate_bytes(fp: Footprint, spec: str, overrides: tuple = (), repacked: bool = True) -> int:
    """Bytes a candidate with weights ``spec`` (``FORMAT[+METHOD]``) adds to the loaded model: its quantized layers'
    packed bytes, twice where the native kernels multiply a repacked copy kept beside them (int8, int4, fp8, …:
    an engine's model); a layer the format leaves as it is shares the loaded one (its blocks at float
    activations), unless its block type has no native kernel (then float32). ``repacked=False``: the packed bytes
    once (before any product, or ``optimize``'s candidates, kept only in the native layout)."""
    from ..models.quantize import QuantizeConfig
    from ..quant import build_format

    config = QuantizeConfig(format=_format_of(spec), overrides=dict(overrides))
    total = 0
    for name, (out, inp) in fp.linear.items():
        layer_spec = config.spec_for(name)
        if layer_spec is None:
            kept_float = fp.linear_loaded[name] in (0, out * inp * 4) or name in fp.linear_native
            total += 0 if kept_float else out * inp * 4
        else:
            fmt = build_format(layer_spec)
            packed = int(fmt.bits_per_weight(out, inp) * out * inp / 8)
            total += packed * (2 if repacked and _repacked(fmt) else 1)
    return total


def quantizing_bytes(fp: Footprint, spec: str, repacking: bool = False) -> int:
    """The float32 working set of quantizing a candidate's largest layer (a run of rows at a time where the format's
    rows pack independently, :func:`bytediet.models.quantize.quantized_weight`); ``repacking``: or, if larger, the
    largest layer's native copy made beside its planes (:func:`~bytediet.models.share.native_only`)."""
    from ..models.quantize import ROW_CHUNK_ELEMENTS, QuantizeConfig
    from ..quant import build_format

    config = QuantizeConfig(format=_format_of(spec))
    largest, copy = 0, 0
    for name, (out, inp) in fp.linear.items():
        layer_spec = config.spec_for(name)
        if layer_spec is not None:
            fmt = build_format(layer_spec)
            rows = out if not fmt.rows_independent else max(1, ROW_CHUNK_ELEMENTS // inp)
            largest = max(largest, min(rows, out) * inp)
            if repacking and _repacked(fmt):
                copy = max(copy, int(fmt.bits_per_weight(out, inp) * out * inp / 8))
    return max(FLOAT_COPIES_WHILE_QUANTIZING * largest * 4, copy)


def measuring_bytes(fp: Footprint) -> int:
    """Scoring a window against the reference (chunks of both logits, their float64 comparison) and a run of
    ``lm_head``'s rows decoded for a prefill."""
    from ..kernels.ops import DECODE_CHUNK_BYTES

    c = fp.config
    chunk = max(64 * c.vocab_size, ROW_CHUNK_ELEMENTS) * 4
    return 2 * chunk + min(c.vocab_size * c.hidden_size * 4, DECODE_CHUNK_BYTES) + COMPARE_CHUNK_BYTES


def _format_of(spec: str) -> str:
    from .candidates import split_method

    return split_method(spec)[0]


def _repacked(fmt) -> bool:
    """Whether a layer of ``fmt`` keeps a native-layout copy of its packed bytes (not GGML blocks, read in place)."""
    from ..quant.base import WeightFormat
    from ..quant.gguf_blocks import GGUFBlocks

    return type(fmt).native_layout is not WeightFormat.native_layout and not isinstance(fmt, GGUFBlocks)


def calibration_bytes(fp: Footprint, method: str, samples: int, length: int) -> int:
    """What calibrating one block needs beside the model: hidden states, the block's float weights, Grams."""
    c = fp.config
    block = {n: s for n, s in fp.linear.items() if n.startswith("model.layers.0.")}
    hidden = 3 * samples * (length + 1) * c.hidden_size * 4  # the block's inputs, its outputs and their stack
    floats = sum(o * i * 4 for o, i in block.values())
    # the block's Grams, and the largest one's factorisation in a working copy beside it (GPTQ, SparseGPT)
    grams = sum(i * i * 8 for _, i in block.values()) + max(i * i * 8 for _, i in block.values())
    grams = grams if method in GRAM_METHODS else 0
    search = 4 * max(o * i for o, i in block.values()) * 4 if method == "awq" else 0  # AWQ's scaled copies
    return hidden + floats + grams + search


def plan_optimize(options) -> MemoryPlan:
    """The predicted peak of ``bytediet optimize`` with ``options`` (:class:`.recipe.OptimizeOptions`)."""
    from ..models.loader import build_model
    from .candidates import calibrated_specs, split_method, weight_specs

    o = options.resolved()
    fp = footprint(o.model, packed_embedding=True)
    c = fp.config
    skeleton = build_model(c)  # linear shapes only: no tensor is read
    rtn_only = None if o.weights is None else [s for s in o.weights if "+" not in s]
    rtn = weight_specs(skeleton, quick=o.quick, only=rtn_only)
    cal_only = None if o.weights is None else [s for s in o.weights if "+" in s]
    specs = rtn.specs + calibrated_specs(skeleton, rtn, quick=o.quick, methods=o.methods, only=cal_only).specs
    measuring = measuring_bytes(fp)
    worst, worst_spec = fp.x4_bytes + measuring, None  # the checkpoint as loaded, measured on its x4 copies
    for spec in specs:
        method = split_method(spec)[1]
        quantizing = quantizing_bytes(fp, spec, repacking=True)
        building = (
            max(calibration_bytes(fp, method, o.calib_samples, o.calib_len), quantizing) if method else quantizing
        )
        need = candidate_bytes(fp, spec, repacked=False) + max(building, measuring)
        if need > worst:
            worst, worst_spec = need, spec
    parts = {"runtime": RUNTIME_BYTES, "tokenizer": fp.tokenizer_bytes, "model": fp.loaded_bytes}
    if fp.loading_bytes > worst + MEASURING_HEAP_BYTES:
        worst_spec = None
        parts["loading (the GGUF's metadata)"] = fp.loading_bytes
    else:
        parts[f"largest step ({worst_spec or 'the checkpoint as loaded, with its x4 copies'})"] = worst
        parts["the heap while measuring"] = MEASURING_HEAP_BYTES
    plan = MemoryPlan("bytediet optimize", parts)
    plan.smaller = _smaller(o, worst_spec)
    plan.largest = worst_spec
    return plan


def fit_to_memory(options, have: int):
    """(options, left out, plan): ``options`` without the calibration methods whose step does not fit in ``have``
    bytes, largest first, until the plan fits or its largest step is no calibrated candidate (GPTQ, Wanda and
    SparseGPT hold float64 Gram matrices of in² × 8 bytes: a 7B's ``down_proj`` alone is 2.9 GB). Nothing is
    left out when the user named the candidates (``--weights``)."""
    from ..calibrate import calibration_method_names
    from .candidates import split_method

    o = options.resolved()
    plan, dropped = plan_optimize(o), []
    while plan.total > have and o.weights is None and plan.largest and "+" in plan.largest:
        method = split_method(plan.largest)[1]
        methods = tuple(m for m in (o.methods if o.methods is not None else calibration_method_names()) if m != method)
        dropped.append(plan.largest)
        o = replace(o, methods=methods)
        plan = plan_optimize(o)
    return o, dropped, plan


def _smaller(o, worst_spec) -> list[str]:
    """Options that shrink the plan's largest term, most effective first."""
    hints = []
    if worst_spec:
        fmt, method = worst_spec.split("+")[0], ("+" in worst_spec)
        hints.append(
            f"leave out {worst_spec}: --methods none"
            if method
            else f"leave out {fmt}: --weights with the other formats"
        )
    hints.append(f"a shorter window: --window-len {max(o.window_len // 2, 64)}")
    return hints
