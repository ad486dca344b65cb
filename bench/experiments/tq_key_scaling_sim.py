"""Offline experiment: does an exact per-channel key rescaling help TurboQuant keys? (answer on SmolLM2: barely)

Keys of every 3rd layer are captured on Austen text (2 × 1024 calibration tokens, one 2048-token eval
window), stored with calibrated TurboQuant (values exact), and the attention KL of the last 256 queries
against exact keys is averaged. "scaled" first divides key channel i by s_i = (E[k_i²]/E[q_i²])^(1/4)
(the Cauchy–Schwarz optimum of the score error for isotropic quantization noise) and multiplies the
query by it, which leaves q·k exact; "scaled_half" uses the exponent 1/8. Result (2026-12-02): KL
0.055 → 0.054 / 0.051 at 3.5 bits, 0.194 → 0.183 / 0.176 at 2.5 bits, too little to adopt.

    .venv/bin/python bench/experiments/tq_key_scaling_sim.py [default|gemma3-270m] [3.5,2.5]
"""

from __future__ import annotations

import math
import sys

import torch

from bytediet.calibrate.kv import capture_kv
from bytediet.eval.corpus import make_windows, tokenize_corpus
from bytediet.kvcache.turboquant import TurboQuantHalf
from bytediet.models.loader import load_model


def attention_kl(config, q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor, n_queries: int = 256) -> float:
    """Mean KL(softmax(q·k) || softmax(q·k̂)) of the last ``n_queries`` causal queries.

    q: (N, Hq, D), k and k_hat: (N, Hkv, D) post-RoPE; heads are grouped as in GQA.
    """
    n, group = k.shape[0], config.num_heads // config.num_kv_heads
    scale = 1 / math.sqrt(config.head_dim)
    future = torch.arange(n)[None, :] > torch.arange(n - n_queries, n)[:, None]
    kls = []
    for h in range(config.num_heads):
        qq = q[n - n_queries :, h]
        logp = (qq @ k[:, h // group].T * scale).masked_fill(future, -1e30).log_softmax(-1)
        logp_hat = (qq @ k_hat[:, h // group].T * scale).masked_fill(future, -1e30).log_softmax(-1)
        kls.append((logp.exp() * (logp - logp_hat)).sum(-1).mean())
    return float(torch.stack(kls).mean())


def round_trip(half: TurboQuantHalf, config, layer: int, x: torch.Tensor) -> torch.Tensor:
    """x (N, Hkv, D), one sequence from position 0, written to and read back from a TurboQuant key page."""
    pages = half.create(layer, "k", math.ceil(x.shape[0] / 16), 16, config.num_kv_heads, config.head_dim, "cpu")
    slots = torch.arange(x.shape[0])
    if pages.uses_positions:  # a pre-RoPE key mean: the slots are the positions here
        pages.write(x, slots, slots)
        return pages.decode(slots, slots)
    pages.write(x, slots)
    return pages.decode(slots)


def main() -> None:
    torch.set_num_threads(2)
    spec = sys.argv[1] if len(sys.argv) > 1 else "default"
    bit_widths = [float(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "3.5,2.5").split(",")]
    model, tokenizer = load_model(spec, dtype=torch.float32)
    c = model.config
    ids = tokenize_corpus(tokenizer, "austen")
    cal = capture_kv(model, [w.ids for w in make_windows(ids, 1024, 2, split="calibration", seed=0)])
    ev = capture_kv(model, [w.ids for w in make_windows(ids, 2048, 1, split="eval", seed=0)])
    group = c.num_heads // c.num_kv_heads
    for bits in bit_widths:
        results: dict[str, list[float]] = {"plain": [], "scaled": [], "scaled_half": []}
        for layer in range(0, c.num_layers, 3):
            kc, qc, ke, qe = cal[layer]["k"], cal[layer]["q"], ev[layer]["k"], ev[layer]["q"]
            half = TurboQuantHalf(bits, "mse", "hadamard")
            half.calibrate(kc, layer, queries=qc)
            results["plain"].append(attention_kl(c, qe, ke, round_trip(half, c, layer, ke)))
            mean = kc.mean(0)
            key_energy = (kc - mean).pow(2).mean(0)  # (Hkv, D)
            query_energy = qc.reshape(-1, c.num_kv_heads, group, c.head_dim).pow(2).mean((0, 2))
            for name, power in (("scaled", 0.25), ("scaled_half", 0.125)):
                s = (key_energy.clamp(min=1e-12) / query_energy.clamp(min=1e-12)).pow(power)
                s = s / s.pow(2).mean(-1, keepdim=True).sqrt()
                q_scaled = (qc.reshape(-1, c.num_kv_heads, group, c.head_dim) * s[None, :, None, :]).reshape(qc.shape)
                scaled_half = TurboQuantHalf(bits, "mse", "hadamard")
                scaled_half.calibrate((kc - mean) / s, layer, queries=q_scaled)
                k_hat = round_trip(scaled_half, c, layer, (ke - mean) / s) * s + mean
                results[name].append(attention_kl(c, qe, ke, k_hat))
        print(spec, bits, {k: round(sum(v) / len(v), 5) for k, v in results.items()}, flush=True)


if __name__ == "__main__":
    main()
