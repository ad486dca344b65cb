"""Peak RSS of ``bytediet optimize --quick`` against checkpoint size: the measured runs, a least-squares line through
them, and what the line and the memory plan say of a 7B Q4_K_M.

Reads the ``report.json`` of each run (``--reports DIR/default DIR/gemma3-270m …``: the ``--out`` directories) and
the header-only 7B GGUFs that ``bench/optimize_memory_headers.py`` writes (their plans: the same code as a run's).

    PYTHONPATH=src python bench/optimize_memory_fit.py --reports /tmp/opt-s14/default /tmp/opt-s14/gemma3-270m \\
        /tmp/opt-s14/qwen2.5-0.5b [--headers /tmp/bytediet-headers] [--json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GB = 1e9
TARGET_7B_BYTES = 4.4e9  # a 7B Q4_K_M (the size)


def run_row(out_dir: Path) -> dict:
    """One measured run: checkpoint bytes, measured and predicted peaks, the issue's limit."""
    from bytediet.perf.memory import footprint

    report = json.loads((out_dir / "report.json").read_text())
    mem = report["memory"]
    ckpt = (
        Path(report["model"]).stat().st_size
        if Path(report["model"]).is_file()
        else footprint(report["model"]).loaded_bytes
    )
    measured, predicted = mem["measured_peak_bytes"], mem["predicted_peak_bytes"]
    now = plan_now(report)
    return {
        "model": report.get("model_name") or report["model"],
        "checkpoint_bytes": ckpt,
        "measured_peak_bytes": measured,
        "predicted_peak_bytes": predicted,
        "prediction_error": predicted / measured - 1.0,
        "plan_now_bytes": now,
        "plan_now_error": now / measured - 1.0,
        "limit_bytes": 3 * ckpt + 2 * GB,
        "steps": mem.get("steps", {}),
        "elapsed_s": report.get("elapsed_s"),
        "skipped": sorted(s["label"] for s in (report.get("time_budget") or {}).get("skipped", [])),
    }


def plan_now(report: dict) -> int:
    """This code's plan for the run's model and preset (the report's own prediction is the code's of its day)."""
    from bytediet.optimize.memory_plan import plan_optimize
    from bytediet.optimize.recipe import OptimizeOptions

    o = report.get("options", {})
    return plan_optimize(OptimizeOptions(model=report["model"], quick=bool(o.get("quick", True)))).total


def fit(rows: list[dict]) -> tuple[float, float]:
    """(intercept, slope) of measured peak against checkpoint bytes, least squares."""
    xs = [r["checkpoint_bytes"] for r in rows]
    ys = [r["measured_peak_bytes"] for r in rows]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if n > 1 and sxx else 0.0
    return my - slope * mx, slope


def header_plans(directory: Path, have: float = 16 * GB) -> dict:
    """Each header-only 7B GGUF's plan: every method, and fitted to a machine of ``have`` bytes."""
    from bytediet.optimize.memory_plan import fit_to_memory, plan_optimize
    from bytediet.optimize.recipe import OptimizeOptions

    out = {}
    for path in sorted(directory.glob("*.gguf")):
        o = OptimizeOptions(model=str(path), quick=True)
        _, left_out, fitted = fit_to_memory(o, have)
        out[path.stem] = {
            "checkpoint_bytes": path.stat().st_size,
            "planned_bytes": plan_optimize(o).total,
            "planned_16gb_bytes": fitted.total,
            "left_out_16gb": left_out,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reports", type=Path, nargs="+", required=True)
    p.add_argument("--headers", type=Path, default=Path("/tmp/bytediet-headers"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = [run_row(d) for d in args.reports]
    a, b = fit(rows)
    result = {
        "runs": rows,
        "fit": {"intercept_bytes": a, "slope": b, "at_7b_q4_k_m_bytes": a + b * TARGET_7B_BYTES},
        "headers": header_plans(args.headers) if args.headers.is_dir() else {},
    }
    if args.json:
        print(json.dumps(result, default=float))
        return
    print(
        "| model | checkpoint | peak RSS | limit 3 × ckpt + 2 GB | predicted at run | error | plan now | error | wall |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        wall = f"{r['elapsed_s'] / 60:.1f} min" if r["elapsed_s"] else "—"
        print(
            f"| {r['model']} | {r['checkpoint_bytes'] / GB:.2f} GB | {r['measured_peak_bytes'] / GB:.2f} GB | "
            f"{r['limit_bytes'] / GB:.2f} GB | {r['predicted_peak_bytes'] / GB:.2f} GB | "
            f"{100 * r['prediction_error']:+.1f} % | {r['plan_now_bytes'] / GB:.2f} GB | "
            f"{100 * r['plan_now_error']:+.1f} % | {wall} |"
        )
    print(
        f"\nfit: peak = {a / GB:.2f} GB + {b:.2f} × checkpoint → 7B Q4_K_M (4.4 GB): "
        f"{result['fit']['at_7b_q4_k_m_bytes'] / GB:.1f} GB"
    )
    for name, h in result["headers"].items():
        left = ", ".join(h["left_out_16gb"]) or "none"
        print(
            f"plan {name} ({h['checkpoint_bytes'] / GB:.2f} GB): {h['planned_bytes'] / GB:.1f} GB with every method, "
            f"{h['planned_16gb_bytes'] / GB:.1f} GB on a 16 GB machine (left out: {left})"
        )


if __name__ == "__main__":
    main()
