"""Offline experiments: can anything short of more bits bring TurboQuant 3.5/2.5-bit *keys* near int8 quality?

Same protocol as ``tq_key_scaling_sim.py``: post-RoPE K/Q captured on Austen text (2 × 1024 calibration tokens
for the codec, one 2048-token eval window to measure), values exact, and the mean attention KL of the last
256 queries (every 3rd layer) against exact keys. Reaching the issue's +0.5 % perplexity needs a KL near
0.002 (int8 keys: 0.0004 → +0.24 %; TurboQuant 4-bit keys: 0.03 → +5.4 %). Experiments:

* ``transform`` — transform coding instead of a random rotation of the raw channels: the calibrated
  Karhunen–Loève basis of the centred keys (``kltk``) or of the queries (``kltq``), coordinates sorted by
  expected score error λ_k · λ_q, then 2- or 3-part TurboQuant layouts in that basis (each part with its own
  Hadamard rotation and fp16 norm) chosen by predicted error; ``channels`` is the same search on raw channels;
  ``kltk-static-no-norm`` is textbook transform coding (static per-coordinate scales, Gaussian Lloyd–Max,
  integer bits by reverse water-filling, no per-token norm, so the whole budget goes to codes).
* ``layers`` — per-layer bit budgets (1.5 … 5 bits) allocated greedily by the KL each layer shows on a
  separate 2048-token *calibration* window, average held at 3.5 / 2.5 bits, scored on the eval window.
* ``window`` — the W most recent keys of each query kept exact (``W32a``: the query's own 32-token group,
  i.e. a KIVI-style open group), the rest TurboQuant.
* ``groups`` — a per-group key mean (fp16, over g consecutive tokens) subtracted first, its cost taken from
  the TurboQuant budget.

* ``rope`` — the key mean taken *before* RoPE and rotated to each key's position (what calibrated TurboQuant
  does since session 3) against a constant post-RoPE mean (session 2). The other experiments keep the
  constant mean, as measured in session 3 before the change.

    .venv/bin/python bench/experiments/tq_key_alternatives_sim.py \
        [transform|layers|window|groups|rope] [default|gemma3-270m]
"""

from __future__ import annotations

import math
import sys

import torch
from tq_key_scaling_sim import attention_kl, round_trip

from bytediet.calibrate.kv import capture_kv
from bytediet.eval.corpus import make_windows, tokenize_corpus
from bytediet.kvcache.lloyd_max import nearest, sphere_coordinate_codebook
from bytediet.kvcache.turboquant import TurboQuantHalf
from bytediet.kvcache.turboquant_core import TurboQuantizer
from bytediet.kvcache.turboquant_layout import choose_layout, part_distortion
from bytediet.models.loader import load_model

BUDGETS = (3.5, 2.5)


def calibrated_half(bits: float, layer: int, data: dict, pre_rope: bool = False) -> TurboQuantHalf:
    """TurboQuant keys calibrated on ``data``: a constant channel mean, or (``pre_rope``) the pre-RoPE mean."""
    half = TurboQuantHalf(bits, "mse", "hadamard")
    extra = {"positions": data["pos"], "rope": data["rope"]} if pre_rope else {}
    half.calibrate(data["k"], layer, queries=data["q"], **extra)
    return half


def turboquant_kl(
    config, cal, layer: int, k: torch.Tensor, q: torch.Tensor, bits: float, pre_rope: bool = False
) -> float:
    """Attention KL of calibrated TurboQuant keys at ``bits`` (constant mean, or the pre-RoPE mean)."""
    half = calibrated_half(bits, layer, cal[layer], pre_rope)
    return attention_kl(config, q, k, round_trip(half, config, layer, k))


def mean_kls(rows: dict[str, list[float]]) -> dict[str, float]:
    return {name: round(sum(v) / len(v), 5) for name, v in rows.items()}


# ------------------------------------------------------------------------------------------ transform
def three_part_layout(target: float, d: int, importance: torch.Tensor) -> list[tuple[int, int]]:
    """Best 1–3 part layout (parts a multiple of 8, a 0-bit part dropped) by predicted Σ F · D(b)."""
    frac = (importance / importance.sum()).cumsum(0)
    sizes = range(8, d, 8)
    cands = [[(d, b)] for b in range(1, 9)]
    cands += [[(n, hi), (d - n, lo)] for n in sizes for hi in range(2, 9) for lo in range(1, hi)]
    cands += [
        [(n1, b1), (n2, b2), (d - n1 - n2, b3)]
        for n1 in sizes
        for n2 in sizes
        if n1 + n2 < d
        for b1 in range(3, 9)
        for b2 in range(2, b1)
        for b3 in range(0, b2)
    ]
    best, best_err = None, float("inf")
    for lay in cands:
        if sum(n * b + (16 if b else 0) for n, b in lay) > target * d + 1e-9:
            continue
        err, start = 0.0, 0
        for n, b in lay:
            f = float(frac[start + n - 1] - (frac[start - 1] if start else 0))
            err += f * (part_distortion(b, "mse") if b else 1.0)
            start += n
        if err < best_err:
            best, best_err = lay, err
    return best


def head_statistics(config, cal: dict, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KV head h's calibration key mean (D,), centred key covariance and query second moment (D, D), float64."""
    d, hkv = config.head_dim, config.num_kv_heads
    k = cal["k"][:, h].double()
    mu = k.mean(0)
    q = cal["q"].reshape(-1, hkv, config.num_heads // hkv, d)[:, h].reshape(-1, d).double()
    return mu, (k - mu).T @ (k - mu) / k.shape[0], q.T @ q / q.shape[0]


def transform_round_trip(config, cal: dict, keys: torch.Tensor, target: float, basis: str, parts: int) -> torch.Tensor:
    d = config.head_dim
    out = torch.empty_like(keys)
    for h in range(config.num_kv_heads):
        mu, ck, cq = head_statistics(config, cal, h)
        u = {
            "kltk": lambda: torch.linalg.eigh(ck)[1],
            "kltq": lambda: torch.linalg.eigh(cq)[1],
            "channels": lambda: torch.eye(d, dtype=torch.float64),
        }[basis]()
        importance = torch.einsum("di,de,ei->i", u, ck, u) * torch.einsum("di,de,ei->i", u, cq, u)
        order = torch.argsort(importance, descending=True)
        u, importance = u[:, order], importance[order]
        lay = three_part_layout(target, d, importance) if parts == 3 else choose_layout(target, d, "mse", importance)
        y = (keys[:, h].double() - mu) @ u
        rec, start = [], 0
        for i, (n, b) in enumerate(lay):
            yp = y[:, start : start + n].float()
            start += n
            if b == 0:
                rec.append(torch.zeros_like(yp))
                continue
            tq = TurboQuantizer(n, b, "mse", "hadamard", 11 + i + 7 * h)
            rec.append(tq.dequantize(tq.quantize(yp)))
        out[:, h] = (torch.cat(rec, -1).double() @ u.T + mu).float()
    return out


def gaussian_codebook(bits: int) -> torch.Tensor:
    """Lloyd–Max codebook of N(0, 1): the sphere-coordinate codebook at a large dimension, rescaled."""
    return sphere_coordinate_codebook(4096, bits)[0] * 64.0


def static_round_trip(config, cal: dict, keys: torch.Tensor, target: float) -> torch.Tensor:
    """Classic transform coding without per-token norms: KLT of the centred keys, each coordinate scaled by
    its calibrated standard deviation and quantized with a Gaussian Lloyd–Max codebook; integer bits per
    coordinate allocated greedily by expected score error (reverse water-filling), ``target · d`` bits."""
    d = config.head_dim
    out = torch.empty_like(keys)
    for h in range(config.num_kv_heads):
        mu, ck, cq = head_statistics(config, cal, h)
        lam, u = torch.linalg.eigh(ck)
        weight = (lam * torch.einsum("di,de,ei->i", u, cq, u)).tolist()
        sigma = ((cal["k"][:, h].double() - mu) @ u).std(0).clamp(min=1e-12)
        bits = [0] * d
        for _ in range(int(target * d)):
            gain = [
                w * (part_distortion(b, "mse") if b else 1.0) - w * part_distortion(b + 1, "mse") if b < 8 else -1.0
                for w, b in zip(weight, bits)
            ]
            bits[max(range(d), key=gain.__getitem__)] += 1
        z = ((keys[:, h].double() - mu) @ u) / sigma
        zq = torch.zeros_like(z)
        for i, b in enumerate(bits):
            if b:
                cb = gaussian_codebook(b).double()
                zq[:, i] = cb[nearest(z[:, i].float(), cb.float())]
        out[:, h] = ((zq * sigma) @ u.T + mu).float()
    return out


def transform(config, cal, ev, sens) -> None:
    for bits in BUDGETS:
        rows: dict[str, list[float]] = {}
        for layer in range(0, config.num_layers, 3):
            k, q = ev[layer]["k"], ev[layer]["q"]
            rows.setdefault("turboquant", []).append(turboquant_kl(config, cal, layer, k, q, bits))
            for basis in ("channels", "kltk", "kltq"):
                for parts in (2, 3):
                    k_hat = transform_round_trip(config, cal[layer], k, bits, basis, parts)
                    rows.setdefault(f"{basis}-{parts}part", []).append(attention_kl(config, q, k, k_hat))
            rows.setdefault("kltk-static-no-norm", []).append(
                attention_kl(config, q, k, static_round_trip(config, cal[layer], k, bits))
            )
        print("transform", bits, mean_kls(rows), flush=True)


# ------------------------------------------------------------------------------------------ layers
def layers(config, cal, ev, sens) -> None:
    budgets = [1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0]
    kl_cal = torch.zeros(config.num_layers, len(budgets))
    kl_ev = torch.zeros_like(kl_cal)
    for layer in range(config.num_layers):
        for j, b in enumerate(budgets):
            half = calibrated_half(b, layer, cal[layer])
            for store, data in ((kl_cal, sens), (kl_ev, ev)):
                k, q = data[layer]["k"], data[layer]["q"]
                store[layer, j] = attention_kl(config, q, k, round_trip(half, config, layer, k))
    for target in BUDGETS:
        idx = torch.zeros(config.num_layers, dtype=torch.long)  # every layer starts at the lowest budget
        for _ in range(int(round((target - budgets[0]) / 0.5 * config.num_layers))):
            gain = torch.tensor(
                [
                    kl_cal[lay, i] - kl_cal[lay, i + 1] if i + 1 < len(budgets) else -1e9
                    for lay, i in enumerate(idx.tolist())
                ]
            )
            idx[int(gain.argmax())] += 1
        uniform = float(kl_ev[:, budgets.index(target)].mean())
        allocated = float(kl_ev[torch.arange(config.num_layers), idx].mean())
        print(
            "layers",
            target,
            {
                "uniform": round(uniform, 5),
                "per-layer": round(allocated, 5),
                "budgets": [budgets[i] for i in idx.tolist()],
            },
            flush=True,
        )


# ------------------------------------------------------------------------------------------ window
def windowed_kl(config, q, k, k_hat, width: int, aligned: bool, n_queries: int = 256) -> float:
    n, group = k.shape[0], config.num_heads // config.num_kv_heads
    qpos, kpos = torch.arange(n - n_queries, n)[:, None], torch.arange(n)[None, :]
    future = kpos > qpos
    exact = (kpos // width == qpos // width) if aligned else (kpos > qpos - width)
    kls = []
    for h in range(config.num_heads):
        qq = q[n - n_queries :, h] / math.sqrt(config.head_dim)
        s = qq @ k[:, h // group].T
        s_hat = torch.where(exact, s, qq @ k_hat[:, h // group].T)
        lp, lh = s.masked_fill(future, -1e30).log_softmax(-1), s_hat.masked_fill(future, -1e30).log_softmax(-1)
        kls.append((lp.exp() * (lp - lh)).sum(-1).mean())
    return float(torch.stack(kls).mean())


def window(config, cal, ev, sens) -> None:
    for bits in BUDGETS:
        rows: dict[str, list[float]] = {}
        for layer in range(0, config.num_layers, 3):
            k, q = ev[layer]["k"], ev[layer]["q"]
            k_hat = round_trip(calibrated_half(bits, layer, cal[layer]), config, layer, k)
            for width, aligned in ((1, False), (8, False), (32, True), (32, False), (128, False)):
                rows.setdefault(f"W{width}{'a' if aligned else ''}", []).append(
                    windowed_kl(config, q, k, k_hat, width, aligned)
                )
        print("window", bits, mean_kls(rows), flush=True)


# ------------------------------------------------------------------------------------------ groups
def group_means(x: torch.Tensor, g: int) -> torch.Tensor:
    """(N, H, D) → the fp16-rounded mean of each run of g tokens, broadcast back to (N, H, D)."""
    n = x.shape[0] // g * g
    full = x[:n].reshape(-1, g, *x.shape[1:]).mean(1, keepdim=True).expand(-1, g, -1, -1).reshape(n, *x.shape[1:])
    tail = x[n:].mean(0, keepdim=True).expand(x.shape[0] - n, -1, -1)
    return torch.cat([full, tail]).half().float()


def groups(config, cal, ev, sens) -> None:
    for bits in BUDGETS:
        rows: dict[str, list[float]] = {}
        for layer in range(0, config.num_layers, 3):
            k, q = ev[layer]["k"], ev[layer]["q"]
            rows.setdefault("turboquant", []).append(turboquant_kl(config, cal, layer, k, q, bits))
            for g in (32, 64, 128):
                rest = bits - 16 / g
                half = calibrated_half(
                    rest, layer, {"k": cal[layer]["k"] - group_means(cal[layer]["k"], g), "q": cal[layer]["q"]}
                )
                half.means[layer] = torch.zeros_like(half.means[layer])
                mean = group_means(k, g)
                k_hat = round_trip(half, config, layer, k - mean) + mean
                rows.setdefault(f"g{g} + turboquant{rest:g}", []).append(attention_kl(config, q, k, k_hat))
        print("groups", bits, mean_kls(rows), flush=True)


# ------------------------------------------------------------------------------------------ rope
def rope(config, cal, ev, sens) -> None:
    """The key mean taken after RoPE (a constant) against before RoPE (rotated to each key's position)."""
    for bits in BUDGETS:
        rows: dict[str, list[float]] = {}
        for layer in range(0, config.num_layers, 3):
            k, q = ev[layer]["k"], ev[layer]["q"]
            rows.setdefault("post-RoPE constant mean", []).append(turboquant_kl(config, cal, layer, k, q, bits))
            rows.setdefault("pre-RoPE mean", []).append(turboquant_kl(config, cal, layer, k, q, bits, True))
        print("rope", bits, mean_kls(rows), flush=True)


def main() -> None:
    torch.set_num_threads(1)
    experiment = sys.argv[1] if len(sys.argv) > 1 else "transform"
    spec = sys.argv[2] if len(sys.argv) > 2 else "default"
    model, tokenizer = load_model(spec, dtype=torch.float32)
    ids = tokenize_corpus(tokenizer, "austen")
    cal = capture_kv(model, [w.ids for w in make_windows(ids, 1024, 2, split="calibration", seed=0)])
    ev = capture_kv(model, [w.ids for w in make_windows(ids, 2048, 1, split="eval", seed=0)])
    sens = (
        capture_kv(model, [w.ids for w in make_windows(ids, 2048, 1, split="calibration", seed=5)])
        if experiment == "layers"
        else None
    )
    experiments = {"transform": transform, "layers": layers, "window": window, "groups": groups, "rope": rope}
    experiments[experiment](model.config, cal, ev, sens)


if __name__ == "__main__":
    main()
