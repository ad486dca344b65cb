"""Re-check a recommendation from its files alone: load ``recommended.json`` as the engine would, score the
same evaluation windows against the unmodified model, and compare with what ``report.json`` promised.

Meant for a fresh process (``python -m bytediet.optimize.verify OUT_DIR``): nothing is shared with the run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch


def verify(out_dir: str | Path) -> dict:
    """{"ppl", "ppl_ref", "ppl_increase_pct", "reported": {...}, "within_budget"} for the recommended config."""
    from ..eval.corpus import make_windows
    from ..eval.fidelity import kl_per_position, next_token_pairs, token_nll
    from ..eval.harness import tokenize_corpus
    from ..kvcache.base import build_kv_codec
    from ..models.loader import load_model
    from .budget import Budget, within
    from .run_config import load_run_config

    out = Path(out_dir)
    report = json.loads((out / "report.json").read_text())
    kwargs = load_run_config(out / "recommended.json")
    s = report["settings"]
    # the unmodified model the report measured against (a calibrated recommendation points at its own checkpoint)
    reference, tokenizer = load_model(report["model"], dtype=torch.float32)
    model = kwargs["loaded"][0] if "loaded" in kwargs else load_model(kwargs["model"], weights=kwargs["weights"])[0]
    ids = tokenize_corpus(tokenizer, s["corpus"])
    bos = torch.tensor(tokenizer.encode("", add_special_tokens=True), dtype=torch.long)
    # the codec the engine would build: its name plus the calibration state the run config produced
    test_kv = build_kv_codec(
        kwargs["kv_cache_dtype"], kwargs.get("kv_calibration_state"), model.dtype, getattr(model, "rope", None)
    )
    totals, kl = {"ref": [0.0, 0], "test": [0.0, 0]}, []
    for w in make_windows(ids, s["window_len"], s["windows"], split="eval", seed=s["seed"]):
        seq, logits = torch.cat([bos, w.ids]), {}
        for name, m, kv in (("ref", reference, "auto"), ("test", model, test_kv)):
            logits[name], targets = next_token_pairs(m.score(seq, kv_codec=kv)[len(bos) :], w.ids)
            totals[name][0] += float(token_nll(logits[name], targets).sum())
            totals[name][1] += len(targets)
        kl.append(kl_per_position(logits["ref"], logits["test"]))
    ppl_ref, ppl = (math.exp(totals[k][0] / totals[k][1]) for k in ("ref", "test"))
    rec = report["recommendation"]["record"]
    result = {
        "ppl": ppl,
        "ppl_ref": ppl_ref,
        "ppl_increase_pct": 100 * (ppl / ppl_ref - 1),
        "kl_mean": float(torch.cat(kl).mean()),
        "reported": {k: rec[k] for k in ("ppl", "ppl_ref", "ppl_increase_pct", "kl_mean")},
    }
    result["within_budget"] = within(result, Budget(**report["budget"]))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bytediet.optimize.verify", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", help="the output directory of `bytediet optimize`")
    print(json.dumps(verify(parser.parse_args(argv).out_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
