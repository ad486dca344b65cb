"""Roofline figure: each device's roof (log-log) and the predicted operators as points on it."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .hardware import HardwareSpec
from .roofline import Prediction


def plot_roofline(
    predictions: Sequence[Prediction], hardware: dict[str, HardwareSpec], path: str | Path, title: str = ""
) -> Path:
    """Write a PNG: attainable FLOP/s = min(peak, intensity × bandwidth) per device; one marker per
    (operator, phase, batch) at (arithmetic intensity, achieved FLOP/s = FLOPs / predicted time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(10, 6.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = {"prefill": "s", "decode": "o"}
    x = np.logspace(-2, 5, 200)
    for idx, hw_id in enumerate(dict.fromkeys(p.hardware for p in predictions)):
        hw, color = hardware[hw_id], colors[idx % len(colors)]
        preds = [p for p in predictions if p.hardware == hw_id]
        peak = hw.peak(preds[0].compute_dtype)
        ax.plot(
            x,
            np.minimum(peak, x * hw.memory_bandwidth),
            color=color,
            label=f"{hw.id}: {peak / 1e12:.4g} TFLOP/s ({preds[0].compute_dtype}), "
            f"{hw.memory_bandwidth / 1e12:.3g} TB/s",
        )
        for p in preds:
            for phase in (p.prefill, p.decode):
                for op in phase.ops:
                    if op.flops <= 0 or op.time <= 0:
                        continue
                    ax.scatter(
                        op.intensity,
                        op.flops / op.time,
                        color=color,
                        marker=markers[phase.phase],
                        s=18 + 4 * len(op.name),
                        alpha=0.75,
                        edgecolors="none",
                    )
                    if phase.phase == "decode" and p is preds[0]:
                        ax.annotate(
                            op.name,
                            (op.intensity, op.flops / op.time),
                            fontsize=7,
                            color=color,
                            xytext=(3, -9),
                            textcoords="offset points",
                        )
    ax.scatter([], [], marker="s", color="gray", label="prefill operators")
    ax.scatter([], [], marker="o", color="gray", label="decode operators")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(title or "roofline")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_concurrency(series: dict[str, dict[int, dict]], path: str | Path, title: str = "") -> Path:
    """Write a PNG: TTFT p50/p99, TPOT p50/p99 and output tokens/s against concurrency, one colour per system.

    ``series``: system → level → ``{"ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "output_tokens_per_s"}``
    (a missing or None value leaves a gap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("ttft", "TTFT (s)", 1.0), ("tpot", "TPOT (ms)", 1e3)]
    levels = sorted({level for by_level in series.values() for level in by_level})
    for i, (name, by_level) in enumerate(series.items()):
        xs = sorted(by_level)
        for ax, (key, label, scale) in zip(axes, panels):
            for p, style in (("p50", "-o"), ("p99", "--x")):
                ys = [by_level[x].get(f"{key}_{p}_s") for x in xs]
                ax.plot(
                    xs, [y * scale if y is not None else None for y in ys], style, color=f"C{i}", label=f"{name} {p}"
                )
                ax.set_ylabel(label)
        axes[2].plot(xs, [by_level[x].get("output_tokens_per_s") for x in xs], "-o", color=f"C{i}", label=name)
    axes[2].set_ylabel("output tokens/s")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(x) for x in levels])
        ax.set_xlabel("concurrent requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def concurrency_series(systems: dict[str, dict]) -> dict[str, dict[int, dict]]:
    """``bytediet bench``'s ``systems`` → :func:`plot_concurrency`'s series (systems with a concurrency part)."""
    return {
        name: {int(level): stats for level, stats in r["concurrency"].items()}
        for name, r in systems.items()
        if r.get("concurrency")
    }
