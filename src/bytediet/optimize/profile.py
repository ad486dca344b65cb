"""Step 1 of the recipe, "measure first": prefill vs decode on this machine, placed on its roofline.

The unmodified model generates once through the engine (greedy, batch 1): a prompt of ``prompt_len``
tokens (prefill, timed to the first token) and ``new_tokens`` more (decode). The roofline analyzer
(:func:`bytediet.perf.roofline.analyze`, Williams et al. 2009) predicts the FLOPs and bytes of both
phases for this model on *this machine's measured ceilings* (:func:`bytediet.perf.measure.this_machine`, or
:func:`bytediet.perf.measure_gpu.this_gpu` where the model is on CUDA);
dividing by the measured times gives the achieved FLOP/s and bytes/s, i.e. each phase's point on the
roofline, and the analyzer says which bound applies (compute or memory).
"""

from __future__ import annotations

from typing import Any


def weight_bits(model) -> float:
    """All-in bits per parameter of the model as loaded (8 · bytes / parameters)."""
    return 8.0 * model.weight_bytes() / model.config.num_parameters


def predict(model, hardware, *, kv: str, weight_bytes: float, prompt_len: int, context: int):
    """The analyzer's prediction for ``model`` on ``hardware`` with ``weight_bytes`` of weights and codec ``kv``."""
    from ..kvcache import get_kv_codec
    from ..perf.roofline import analyze

    bits = 8.0 * weight_bytes / model.config.num_parameters
    return analyze(
        model.config,
        hardware,
        weights=bits,
        kv=get_kv_codec(kv, model.dtype),
        batch=1,
        context=context,
        prompt_len=prompt_len,
        compute_dtype="fp32",
    )


def _generate(model, tokenizer, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(time to first token, decode seconds for new_tokens − 1 tokens) of one greedy generation."""
    from ..engine.llm import LLM
    from ..engine.params import SamplingParams

    llm = LLM(
        "profile",
        loaded=(model, tokenizer),
        enable_prefix_caching=False,
        device=model.device.type,
        kv_cache_memory=64 << 20,
        max_num_batched_tokens=max(512, len(prompt)),
    )
    llm.generate([prompt[:8]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))[0]
    return out.ttft, out.finish_time - out.first_token_time


def _hardware(device, threads: int):
    """The measured ceilings of where ``model`` runs: a GPU's (measured now if not cached), else this CPU's."""
    if device.type == "cuda":
        from ..perf.measure_gpu import this_gpu

        return this_gpu(str(device))
    from ..perf.measure import this_machine

    return this_machine(measure_if_missing=True, threads=threads)


def profile(model, tokenizer, corpus_ids, *, prompt_len: int, new_tokens: int, threads: int) -> dict[str, Any]:
    """Measure prefill and decode, place both on this machine's roofline; a JSON-ready dict."""
    hw = _hardware(model.device, threads)
    prompt_len = min(prompt_len, model.config.max_position_embeddings - new_tokens - 1, len(corpus_ids))
    prompt = [int(t) for t in corpus_ids[:prompt_len]]
    ttft, decode_s = _generate(model, tokenizer, prompt, new_tokens)
    pred = predict(
        model,
        hw,
        kv="auto",
        weight_bytes=model.weight_bytes(),
        prompt_len=prompt_len,
        context=prompt_len + new_tokens // 2,
    )
    phases = {}
    for name, phase, seconds, tokens in (
        ("prefill", pred.prefill, ttft, prompt_len),
        ("decode", pred.decode, decode_s / (new_tokens - 1), 1),
    ):
        phases[name] = {
            "tokens": tokens,
            "measured_s": seconds,
            "tok_s": tokens / seconds,
            "flops": phase.flops,
            "bytes": phase.bytes,
            "intensity": phase.flops / phase.bytes,
            "achieved_flops": phase.flops / seconds,
            "achieved_bandwidth": phase.bytes / seconds,
            "predicted_s": phase.time,
            "bound": phase.bound,
            "fraction_of_peak_flops": phase.flops / seconds / hw.peak("fp32"),
            "fraction_of_bandwidth": phase.bytes / seconds / hw.memory_bandwidth,
        }
    return {
        "hardware": {
            "id": hw.id,
            "name": hw.name,
            "peak_flops_fp32": hw.peak("fp32"),
            "read_bandwidth": hw.memory_bandwidth,
            "memory_bytes": hw.memory_bytes,
        },
        "weight_bytes": model.weight_bytes(),
        "weight_bits": weight_bits(model),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "phases": phases,
        "ridge_intensity": hw.peak("fp32") / hw.memory_bandwidth,
        "sentence": explain(phases, hw),
    }


def explain(phases: dict, hw) -> str:
    """One plain sentence per phase: which bound applies and how close the measurement gets to it."""
    out = []
    for name, p in phases.items():
        if p["bound"] == "memory":
            detail = (
                f"it reads {p['bytes'] / 1e6:.0f} MB per step at {p['intensity']:.2f} FLOP/byte, below this "
                f"machine's ridge point of {hw.peak('fp32') / hw.memory_bandwidth:.1f} FLOP/byte; achieved "
                f"{p['achieved_bandwidth'] / 1e9:.2f} GB/s = {100 * p['fraction_of_bandwidth']:.0f}% of the "
                f"measured {hw.memory_bandwidth / 1e9:.1f} GB/s — fewer bytes (weights, KV) make it faster"
            )
        else:
            detail = (
                f"{p['intensity']:.0f} FLOP/byte is above the ridge point of "
                f"{hw.peak('fp32') / hw.memory_bandwidth:.1f}; achieved {p['achieved_flops'] / 1e9:.1f} GFLOP/s"
                f" = {100 * p['fraction_of_peak_flops']:.0f}% of the measured "
                f"{hw.peak('fp32') / 1e9:.0f} GFLOP/s — fewer bytes help little, cheaper arithmetic would"
            )
        out.append(
            f"{name} ({p['tokens']} token{'s' if p['tokens'] != 1 else ''}, {p['tok_s']:.1f} tok/s) is "
            f"{p['bound']}-bound: {detail}."
        )
    return " ".join(out)
