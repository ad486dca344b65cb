"""The peak memory of an ``optimize`` run, predicted from the checkpoint's header and the options.

One model is resident (the checkpoint as the engine runs it, :meth:`.recipe.Recipe._load`); one candidate at a
time beside it (its own packed layers, float32 for the layers its format leaves as they are); and the larger
of what building it and measuring it need for a moment:

* building: one layer dequantized to float32 while it is quantized (a few copies of the largest layer); a
  calibrated candidate holds one block's float weights, the hidden states of its windows and — GPTQ, Wanda,
  SparseGPT — a float64 Gram matrix per layer of the block (in² × 8 bytes each);
* measuring: a chunk of a window's test logits and the same rows of its reference read back (at most
  :data:`~bytediet.eval.tasks.ROW_CHUNK_ELEMENTS` float32 each), the float64 comparison of a few rows, and
  ``lm_head`` decoded once for a prefill chunk (vocab × hidden float32).
"""

from __future__ import annotations

from ..eval.tasks import ROW_CHUNK_ELEMENTS
from ..perf.memory import RUNTIME_BYTES, TOKENIZER_BYTES_PER_TOKEN, Footprint, MemoryPlan, footprint

FLOAT_COPIES_WHILE_QUANTIZING = 3  # the float weight, its scaled / rounded working copy, and the packed result
COMPARE_CHUNK_BYTES = 6 * (1 << 22) * 8  # fidelity's float64 log-softmax chunks (eval/fidelity.py), ref and test
GRAM_METHODS = ("gptq", "wanda", "sparsegpt")  # capture(hessian=True)


def candidate_bytes(fp: Footprint, spec: str, overrides: tuple = ()) -> int:
    """Bytes of the linear layers of a candidate with weights ``spec`` (``FORMAT[+METHOD]``)."""
    from ..models.quantize import QuantizeConfig
    from ..quant import build_format
    from .candidates import split_method

    config = QuantizeConfig(format=split_method(spec)[0], overrides=dict(overrides))
    total = 0
    for name, (out, inp) in fp.linear.items():
        layer_spec = config.spec_for(name)
        if layer_spec is None:  # kept as loaded: float32 (a float tied head shares the embedding)
            total += out * inp * 4 if fp.linear_loaded[name] else 0
        else:
            total += int(build_format(layer_spec).bits_per_weight(out, inp) * out * inp / 8)
    return total


def calibration_bytes(fp: Footprint, method: str, samples: int, length: int) -> int:
    """What calibrating one block needs beside the model: hidden states, the block's float weights, Grams."""
    c = fp.config
    block = {n: s for n, s in fp.linear.items() if n.startswith("model.layers.0.")}
    hidden = 3 * samples * (length + 1) * c.hidden_size * 4  # the block's inputs, its outputs and their stack
    floats = sum(o * i * 4 for o, i in block.values())
    grams = 2 * sum(i * i * 8 for _, i in block.values()) if method in GRAM_METHODS else 0  # + H = 2G/T
    search = 4 * max(o * i for o, i in block.values()) * 4 if method == "awq" else 0  # AWQ's scaled copies
    return hidden + floats + grams + search


def plan_optimize(options) -> MemoryPlan:
    """The predicted peak of ``bytediet optimize`` with ``options`` (:class:`.recipe.OptimizeOptions`)."""
    from ..models.loader import build_model
    from .candidates import calibrated_specs, split_method, weight_specs

    o = options.resolved()
    fp = footprint(o.model)
    c = fp.config
    skeleton = build_model(c)  # linear shapes only: no tensor is read
    rtn_only = None if o.weights is None else [s for s in o.weights if "+" not in s]
    rtn = weight_specs(skeleton, quick=o.quick, only=rtn_only)
    cal_only = None if o.weights is None else [s for s in o.weights if "+" in s]
    specs = rtn.specs + calibrated_specs(skeleton, rtn, quick=o.quick, methods=o.methods, only=cal_only).specs
    chunk = max(64 * c.vocab_size, ROW_CHUNK_ELEMENTS) * 4
    measuring = 2 * chunk + c.vocab_size * c.hidden_size * 4 + COMPARE_CHUNK_BYTES
    quantizing = FLOAT_COPIES_WHILE_QUANTIZING * fp.largest_linear_floats * 4
    worst, worst_spec = measuring, None  # the baseline: the loaded model itself, measured
    for spec in specs:
        method = split_method(spec)[1]
        building = calibration_bytes(fp, method, o.calib_samples, o.calib_len) if method else quantizing
        need = candidate_bytes(fp, spec) + max(building, measuring)
        if need > worst:
            worst, worst_spec = need, spec
    plan = MemoryPlan(
        "bytediet optimize",
        {
            "runtime": RUNTIME_BYTES,
            "tokenizer": TOKENIZER_BYTES_PER_TOKEN * c.vocab_size,
            "model": fp.loaded_bytes,
            f"largest step ({worst_spec or 'the reference'})": worst,
        },
    )
    plan.smaller = _smaller(o, worst_spec)
    return plan


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
