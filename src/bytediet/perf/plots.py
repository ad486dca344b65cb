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
