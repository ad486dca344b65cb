"""Figures of an ``evaluate`` result (read from its JSON dict alone): KL histogram, per-window perplexity."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(result: dict) -> str:
    cfg = result.get("config", {})
    return (
        f"{result.get('model_name', result.get('model', ''))}: weights={cfg.get('weights') or 'as loaded'}, "
        f"kv={cfg.get('kv_codec', 'auto')}"
    )


def plot_kl_histogram(result: dict, path: str | Path) -> Path:
    """Histogram of per-position KL(ref || test) on log-spaced bins; positions below 1e-8 as a separate bar."""
    plt = _pyplot()
    fid = result["tasks"]["ppl"]
    hist, kl = fid["kl_histogram"], fid["kl"]
    edges, counts = np.asarray(hist["edges"]), np.asarray(hist["counts"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(
        edges[:-1], counts, width=np.diff(edges), align="edge", color="#4878d0", edgecolor="white", label="positions"
    )
    if hist["below"]:
        ax.bar(edges[0] / 3, hist["below"], width=edges[0] * 0.4, color="#999999", label=f"< {edges[0]:g}")
    for name, style in (("mean", "-"), ("p99", "--"), ("max", ":")):
        if kl[name] > 0:
            ax.axvline(kl[name], color="#d65f5f", linestyle=style, label=f"{name} {kl[name]:.3g}")
    ax.set_xscale("log")
    ax.set_xlabel("KL(P_ref || P_test) per position [nats]")
    ax.set_ylabel("positions")
    ax.set_title(f"Next-token KL, {kl['count']} positions\n{_label(result)}", fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, plt, path)


def plot_window_ppl(result: dict, path: str | Path) -> Path:
    """Perplexity per evaluation window, reference vs test, windows in corpus order."""
    plt = _pyplot()
    windows = result["tasks"]["ppl"]["per_window"]
    x = np.arange(len(windows))
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(windows) + 3), 4.5))
    ax.bar(x - 0.2, [w["ppl_ref"] for w in windows], width=0.4, label="reference", color="#999999")
    ax.bar(x + 0.2, [w["ppl_test"] for w in windows], width=0.4, label="test", color="#4878d0")
    ax.set_xticks(x, [str(w["start"]) for w in windows], rotation=60, fontsize=7)
    ax.set_xlabel("window start (token offset in the corpus)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"Perplexity per window\n{_label(result)}", fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, plt, path)


def save_figure(fig, plt, path: str | Path) -> Path:
    """Write a figure as PNG (creating folders) and close it; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(result: dict, directory: str | Path) -> list[Path]:
    """Every figure the result supports, as PNGs in ``directory`` (created if needed)."""
    directory = Path(directory)
    if "ppl" not in result.get("tasks", {}):
        return []
    return [
        plot_kl_histogram(result, directory / "kl_histogram.png"),
        plot_window_ppl(result, directory / "window_ppl.png"),
    ]
