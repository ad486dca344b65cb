"""The recommendation and the outputs of ``bytediet optimize``: tables, ``report.json``, ``summary.md``,
``recommended.json`` and the figures — all read from one report dict, so they cannot disagree."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from .budget import Budget, choose, within
from .recipe import STEPS, candidate_records
from .run_config import RunConfig

# (column title, record key): the table shows exactly these JSON values, formatted by format_value
COLUMNS = (
    ("configuration", "label"),
    ("in budget", "within_budget"),
    ("PPL", "ppl"),
    ("ΔPPL %", "ppl_increase_pct"),
    ("KL mean", "kl_mean"),
    ("KL p99", "kl_p99"),
    ("top-1", "top1"),
    ("passkey", "passkey"),
    ("weight bytes", "weight_bytes"),
    ("KV B/token", "kv_bytes_per_token"),
    ("memory bytes", "memory_bytes"),
    ("decode tok/s", "decode_tok_s"),
    ("speedup", "decode_speedup"),
    ("act. ΔPPL pts", "activation_ppl_cost"),
    ("act. top-1 drop", "activation_top1_drop"),
)
STEP_TITLES = {
    "baseline": "unmodified model (the reference)",
    "weights": "weight formats, one at a time",
    "activations": "activation precision of the best weight formats (cost against the same weights)",
    "kv": "KV-cache codecs, one at a time",
    "combined": "the winners combined",
    "sensitive": "sensitive layers kept at higher precision",
}


def format_value(value: Any) -> str:
    """Integers exactly, floats to 6 significant digits, booleans yes/no, None blank."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def recommend(report: dict) -> dict:
    """Annotate every record with ``within_budget`` and add ``report["recommendation"]`` (also returned)."""
    budget = Budget(**report["budget"])
    for step in STEPS[1:]:
        for r in report["steps"].get(step, {}).get("records", []):
            r["within_budget"] = within(r, budget)
    base = report["steps"]["baseline"]["records"][0]
    choice = choose(candidate_records(report), budget, report["objective"])
    rec = choice.record or base
    config = RunConfig(
        model=report["model"],
        weights=rec["weights"],
        weight_overrides=rec["overrides"],
        kv_cache_dtype=rec["kv"],
        engine={"activations": rec["activations"]} if rec.get("activations") else {},
        kv_calibration=report.get("kv_calibration")
        if rec.get("kv_calibrated") and not rec.get("kv_calibration_state")
        else None,
        kv_calibration_state=rec.get("kv_calibration_state"),
        notes={
            "source": "bytediet optimize",
            "objective": report["objective"],
            "budget": report["budget"],
            "within_budget": choice.within_budget,
            "expected": {
                k: rec[k]
                for k in (
                    "ppl",
                    "ppl_ref",
                    "ppl_increase_pct",
                    "kl_mean",
                    "kl_p99",
                    "top1",
                    "weight_bytes",
                    "kv_bytes_per_token",
                    "decode_tok_s",
                )
            },
            "settings": report["settings"],
            "measured_on": report.get("device"),  # the expected numbers' device (a run config runs on any)
        },
    )
    out = {
        "label": rec["label"],
        "within_budget": choice.within_budget,
        "reason": choice.reason,
        "record": rec,
        "run_config": config.to_dict(),
        "vs_baseline": {
            "memory_ratio": rec["memory_bytes"] / base["memory_bytes"],
            "weight_ratio": rec["weight_bytes"] / base["weight_bytes"],
            "kv_ratio": rec["kv_bytes_per_token"] / base["kv_bytes_per_token"],
            "decode_ratio": rec["decode_tok_s"] / base["decode_tok_s"],
        },
    }
    report["recommendation"] = out
    return out


def step_table(report: dict, step: str):
    """A rich Table of one step's records, one row per configuration, cells = format_value(JSON value)."""
    from rich.table import Table

    data = report["steps"][step]
    table = Table(title=f"{step}: {STEP_TITLES[step]}", title_justify="left")
    for title, key in COLUMNS:
        table.add_column(title, justify="left" if key == "label" else "right", no_wrap=key != "label")
    for r in data.get("records", []):
        table.add_row(*(format_value(r.get(key)) for _, key in COLUMNS))
    notes = [data["note"]] if data.get("note") else []
    notes += [f"skipped {spec}: {why}" for spec, why in data.get("skipped", {}).items()]
    if notes:
        table.caption = "\n".join(notes)
        table.caption_justify = "left"
    return table


def profile_table(report: dict):
    from rich.table import Table

    prof = report["steps"]["profile"]
    table = Table(title="profile: prefill vs decode on this machine's roofline", title_justify="left")
    keys = (
        "tokens",
        "measured_s",
        "tok_s",
        "intensity",
        "achieved_flops",
        "achieved_bandwidth",
        "fraction_of_peak_flops",
        "fraction_of_bandwidth",
        "predicted_s",
        "bound",
    )
    table.add_column("phase")
    for k in keys:
        table.add_column(k, justify="right")
    for name, p in prof["phases"].items():
        table.add_row(name, *(format_value(p[k]) for k in keys))
    table.caption = prof["sentence"]
    table.caption_justify = "left"
    return table


def tables(report: dict) -> list:
    return [profile_table(report)] + [step_table(report, s) for s in STEPS[1:] if s in report["steps"]]


def summary_markdown(report: dict) -> str:
    """A short plain-language summary of the run."""
    rec, steps = report["recommendation"], report["steps"]
    r, vs = rec["record"], rec["vs_baseline"]
    lines = [f"# bytediet optimize: {report['model_name']}", ""]
    verdict = "meets" if rec["within_budget"] else "does NOT meet (the budget is impossible here)"
    lines += [
        f"**Recommendation ({report['objective']}):** `{rec['label']}` — it {verdict} the budget "
        f"({Budget(**report['budget']).describe()}): perplexity {r['ppl']:.4g} vs {r['ppl_ref']:.4g} "
        f"({r['ppl_increase_pct']:+.2f}%), mean KL {r['kl_mean']:.3g} nats, top-1 agreement "
        f"{100 * r['top1']:.1f}%; memory {vs['memory_ratio']:.2f}x and decode speed {vs['decode_ratio']:.2f}x "
        f"of the unmodified model{_passkey_clause(r)}. {rec['reason']}.",
        "",
    ]
    notes = rec["run_config"].get("notes", {})
    if notes.get("calibration"):
        lines += [
            f"The {notes['calibration']}-calibrated weights are saved in `{rec['run_config']['model']}/` "
            f"(recommended.json loads them; no calibration at load time).",
            "",
        ]
    state = rec["run_config"].get("kv_calibration_state")
    if isinstance(state, dict) and state.get("plan"):
        counts = Counter(f"k={p['k']},v={p['v']}" for p in state["plan"])
        lines += [
            f"The KV budget `{rec['run_config']['kv_cache_dtype']}` runs the per-layer plan calibration chose "
            f"({', '.join(f'{n}× `{k}`' for k, n in counts.items())}); recommended.json carries it as "
            "`kv_calibration_state`, so loading it never re-calibrates.",
            "",
        ]
    blocks = steps["baseline"]["records"][0].get("native_blocks") or {}
    if not r["weights"] and not r.get("activations") and r["kv"] == "auto":
        own = f"its own {'/'.join(blocks)} blocks" if blocks else "its own weights"
        lines += [
            f"The checkpoint as loaded ({own}, run natively) is already the best on {report['objective']} "
            "within the budget: no weight format, activation precision or KV codec measured here beats it.",
            "",
        ]
    elif vs["decode_ratio"] < 1 and report["objective"] == "throughput":
        lines += [
            "On this machine the recommendation decodes slower than the checkpoint as loaded; it is chosen "
            "for what it saves in memory within the budget.",
            "",
        ]
    lines += ["## What was measured", "", f"1. **Measure first.** {steps['profile']['sentence']}"]
    parts = []
    for step, noun in (("weights", "weight formats"), ("kv", "KV-cache codecs")):
        recs = steps[step]["records"]
        ok = [x for x in recs if x["within_budget"]]
        smallest = f"; the smallest within it is `{min(ok, key=lambda x: x['memory_bytes'])['label']}`" if ok else ""
        parts.append(f"{len(recs)} {noun} measured, {len(ok)} within budget{smallest}")
    lines.append(f"2. **One technique at a time:** {'. '.join(parts)}.")
    lines += [f"   - {sentence}" for sentence in calibration_comparisons(steps["weights"]["records"])]
    lines.append(f"   - {activation_sentence(steps.get('activations', {}))}")
    comb = steps["combined"]
    if comb.get("compounding"):
        c = comb["compounding"]
        how = (
            "compound (the combination loses more than the sum of its parts)"
            if c["compounds"]
            else "add up (no more than the sum of the parts)"
        )
        lines.append(
            f"3. **Combined** {' + '.join(comb['parts'])}: the errors {how}: mean KL "
            f"{c['kl_mean']['combined']:.3g} vs {c['kl_mean']['sum_of_parts']:.3g}, PPL increase "
            f"{c['ppl_increase_pct']['combined']:.2f}% vs {c['ppl_increase_pct']['sum_of_parts']:.2f}%."
        )
    else:
        lines.append(f"3. **Combined:** {comb.get('note', 'nothing to combine')}.")
    sens = steps["sensitive"]["records"]
    none = (
        f"not needed (no weight format better than the budget's best on {report['objective']} was missing the budget)"
    )
    lines.append(
        "4. **Sensitive layers:** "
        + (
            "; ".join(
                f"`{x['label']}` {'meets' if x['within_budget'] else 'misses'} the budget "
                f"({x['ppl_increase_pct']:+.2f}%)"
                for x in sens
            )
            if sens
            else none
        )
        + "."
    )
    lines += [
        "",
        "Run it: `bytediet generate --config recommended.json` or `bytediet serve --config "
        "recommended.json`. Every number is in `report.json`; figures: `pareto.png`, `roofline.png`.",
        f"Accuracy measured on {report['settings']['windows']} windows of {report['settings']['window_len']} "
        f"tokens of {report['settings']['corpus']}; speeds are single runs on a shared machine.",
    ]
    lines += _budget_lines(report)
    return "\n".join(lines) + "\n"


def _budget_lines(report: dict) -> list[str]:
    """What the time budget and the device left out, and the run's memory: predicted against measured."""
    lines = []
    tb = report.get("time_budget") or {}
    if tb.get("skipped"):
        lines += [
            "",
            f"**Time budget** ({tb['seconds'] / 60:.0f} min) reached: not measured "
            + ", ".join(f"`{s['label']}`" for s in tb["skipped"])
            + " (give a larger `--time-budget`).",
        ]
    dev = report.get("device") or {}
    if dev.get("skipped"):
        lines += [
            "",
            f"**Not runnable on {dev['device']}** (no {dev['backend']} kernel, or not buildable there): "
            + "; ".join(f"`{s['label']}` — {s['reason']}" for s in dev["skipped"])
            + ".",
        ]
    mem = report.get("memory") or {}
    if mem.get("measured_peak_bytes"):
        lines += [
            "",
            f"Peak memory {mem['measured_peak_bytes'] / 1e9:.2f} GB measured, "
            f"{mem['predicted_peak_bytes'] / 1e9:.2f} GB predicted before the run.",
        ]
    return lines


def _passkey_clause(r: dict) -> str:
    if r.get("passkey") is None:
        return ""
    return f"; passkey retrieval {100 * r['passkey']:.0f}% (unmodified {100 * r['passkey_ref']:.0f}%)"


def activation_sentence(step: dict) -> str:
    """What the activation-precision step tried and what each variant cost and gained against its parent."""
    recs = step.get("records", [])
    if not recs:
        return f"Activation precision: {step.get('note', 'not measured')}."
    parts = [
        f"`{r['label']}` {r['activation_ppl_cost']:+.2f} PPL points, top-1 "
        f"{-100 * r['activation_top1_drop']:+.1f}%, decode {r['activation_speedup']:.2f}x "
        f"({'accepted' if r['within_budget'] else 'rejected'})"
        for r in recs
    ]
    return "Activation precision (against the same weights): " + "; ".join(parts) + "."


def calibration_comparisons(records: list[dict]) -> list[str]:
    """One sentence per calibrated weight record: its accuracy against round-to-nearest on the same grid."""
    rtn = {r["weights"]: r for r in records if not r.get("method") and not r["overrides"]}
    out = []
    for r in records:
        base = rtn.get(r["weights"]) if r.get("method") and not r["overrides"] else None
        if base is None:
            continue
        ratio = (
            f", {r['ppl_increase_pct'] / base['ppl_increase_pct']:.2f}x the increase"
            if base["ppl_increase_pct"] > 0
            else ""
        )
        out.append(
            f"{r['method']} on {r['weights']}: perplexity {r['ppl_increase_pct']:+.2f}% vs "
            f"{base['ppl_increase_pct']:+.2f}% rounded to nearest{ratio}; mean KL {r['kl_mean']:.3g} vs "
            f"{base['kl_mean']:.3g}."
        )
    return out


def write_outputs(report: dict, out_dir: str | Path) -> dict[str, Path]:
    """recommendation → report.json, recommended.json, summary.md, pareto.png, roofline.png in ``out_dir``."""
    from .plots import plot_pareto, plot_roofline

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if "recommendation" not in report:
        recommend(report)
    paths = {
        "pareto": plot_pareto(report, out / "pareto.png"),
        "roofline": plot_roofline(report, out / "roofline.png"),
        "recommended": RunConfig.from_dict(report["recommendation"]["run_config"]).write(out / "recommended.json"),
    }
    paths["summary"] = out / "summary.md"
    paths["summary"].write_text(summary_markdown(report))
    report["files"] = {k: str(v) for k, v in paths.items()} | {"report": str(out / "report.json")}
    paths["report"] = out / "report.json"
    paths["report"].write_text(json.dumps(report, indent=1, default=float))
    return paths
