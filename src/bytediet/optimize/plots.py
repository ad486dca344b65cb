"""Figures of an ``optimize`` report, drawn from its JSON dict alone: the trade-off (Pareto) and the roofline."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..eval.kv_pareto import clip_limit, pareto_front
from ..eval.plots import save_figure

STEP_STYLE = {
    "baseline": ("#333333", "s"),
    "weights": ("#4878d0", "o"),
    "kv": ("#ee854a", "^"),
    "combined": ("#6acc64", "D"),
    "sensitive": ("#d65f5f", "P"),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panel(ax, records: list[dict], x_key: str, maximize_x: bool, budget: dict, chosen: str) -> None:
    xs = [r[x_key] for r in records]
    raw = [r["ppl_increase_pct"] for r in records]
    top = max(clip_limit(raw), 1.5 * budget["max_ppl_increase"])  # one +3884 % point must not flatten the rest
    ys = [min(y, top) for y in raw]
    off = [f"{r['label']}: {y:+.0f} %" for r, y in zip(records, raw) if y > top]
    if off:
        ax.text(0.01, 0.99, "off scale: " + "; ".join(off), transform=ax.transAxes, fontsize=6, va="top")
    ax.set_ylim(top=top * 1.05)
    for step, (color, marker) in STEP_STYLE.items():
        idx = [i for i, r in enumerate(records) if r["step"] == step]
        if idx:
            ax.scatter([xs[i] for i in idx], [ys[i] for i in idx], c=color, marker=marker, s=45, label=step, zorder=3)
    for x, y, r in zip(xs, ys, records):
        ax.annotate(
            r["label"].replace("w=", "").replace(" kv=", " | "),
            (x, y),
            fontsize=6,
            xytext=(4, 3),
            textcoords="offset points",
        )
        if r["label"] == chosen:
            ax.scatter(
                [x], [y], s=260, facecolors="none", edgecolors="#d62728", linewidths=2, zorder=4, label="recommended"
            )
    front = pareto_front([(-x if maximize_x else x, y) for x, y in zip(xs, raw)])
    ax.plot(
        [xs[i] for i in front], [ys[i] for i in front], color="#999999", linestyle="--", zorder=1, label="Pareto front"
    )
    ax.axhline(budget["max_ppl_increase"], color="#d62728", linestyle=":", label="budget")
    ax.set_ylabel("perplexity increase vs unmodified [%]")
    ax.grid(True, alpha=0.3)


def plot_pareto(report: dict, path: str | Path) -> Path:
    """Accuracy loss (PPL increase %) against memory bytes (left) and against decode tok/s (right)."""
    plt = _pyplot()
    records = [r for step in report["steps"].values() if isinstance(step, dict) for r in step.get("records", [])]
    chosen = (report.get("recommendation") or {}).get("label", "")
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 6))
    _panel(left, records, "memory_bytes", False, report["budget"], chosen)
    left.set_xscale("log")
    left.set_xlabel(f"weights + KV cache of one {report['options']['context']}-token sequence [bytes]")
    _panel(right, records, "decode_tok_s", True, report["budget"], chosen)
    right.set_xlabel("decode speed, batch 1 [tokens/s] (measured on this machine)")
    handles, labels = left.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    left.legend(unique.values(), unique.keys(), fontsize=8)
    fig.suptitle(f"{report['model_name']}: accuracy loss vs memory and speed (lower-left / lower-right is better)")
    return save_figure(fig, plt, path)


def plot_roofline(report: dict, path: str | Path) -> Path:
    """This machine's measured roof with the measured prefill and decode points of the unmodified model."""
    plt = _pyplot()
    prof = report["steps"]["profile"]
    hw, phases = prof["hardware"], prof["phases"]
    peak, bw = hw["peak_flops_fp32"], hw["read_bandwidth"]
    lo = min(0.05, *(p["intensity"] / 3 for p in phases.values()))
    hi = max(1e3, *(p["intensity"] * 3 for p in phases.values()))
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    fig, ax = plt.subplots(figsize=(9, 6))
    ax.plot(
        x,
        np.minimum(peak, x * bw),
        color="#333333",
        label=f"{hw['name']}: {peak / 1e9:.0f} GFLOP/s fp32, {bw / 1e9:.1f} GB/s (measured)",
    )
    for (name, p), color in zip(phases.items(), ("#4878d0", "#ee854a")):
        ax.scatter(
            [p["intensity"]],
            [p["achieved_flops"]],
            s=80,
            color=color,
            zorder=3,
            label=f"{name} measured ({p['bound']}-bound, {p['tok_s']:.1f} tok/s)",
        )
        ax.scatter(
            [p["intensity"]],
            [p["flops"] / p["predicted_s"]],
            s=80,
            facecolors="none",
            edgecolors=color,
            zorder=3,
            label=f"{name} roofline prediction",
        )
    ax.axvline(peak / bw, color="#999999", linestyle=":", label=f"ridge point {peak / bw:.1f} FLOP/byte")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity [FLOP / byte]")
    ax.set_ylabel("FLOP/s")
    ax.set_title(f"{report['model_name']}: prefill vs decode on this machine's roofline")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="lower right")
    return save_figure(fig, plt, path)
