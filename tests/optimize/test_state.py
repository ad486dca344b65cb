"""The step cache's reference: one file per window on disk, read back one window at a time, metrics unchanged."""

from __future__ import annotations

import pytest
import torch

from bytediet.eval.harness import EvalSettings, evaluate_loaded, reference_cache
from bytediet.eval.tasks import FidelityTask
from bytediet.models.loader import load_model
from bytediet.optimize.state import StepCache
from tests.eval.test_harness import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("state-ckpt"))


def fidelity(result: dict) -> dict:
    r = result["tasks"]["ppl"]
    return {k: r[k] for k in ("reference", "test", "ppl_ratio", "kl", "top1_agreement", "per_window")}


def test_per_window_reference_on_disk_gives_todays_metrics_and_resumes(ckpt, tmp_path, monkeypatch):
    s = EvalSettings(corpus=str(ckpt / "corpus.txt"), windows=3, window_len=40, tasks=("ppl",))
    model, tok = load_model(ckpt)
    label = model.source_path
    today = evaluate_loaded(model, tok, settings=s, weights="int4-g32", progress=False)  # logits in RAM
    cache = StepCache(tmp_path, "k")
    ref = reference_cache(label, s, directory=cache.reference_dir)
    model, tok = load_model(ckpt)
    lean = evaluate_loaded(model, tok, settings=s, weights="int4-g32", progress=False, reference=ref)
    assert fidelity(lean) == fidelity(today)
    assert ref._ram == {} and sorted(p.name for p in cache.reference_dir.glob("window*.f32")) == [
        "window0.f32",
        "window1.f32",
        "window2.f32",
    ]
    cache.save_reference(ref, s.windows)

    monkeypatch.setattr(FidelityTask, "measure_reference", lambda *a: pytest.fail("the reference ran again"))
    again = reference_cache(label, s, directory=StepCache(tmp_path, "k").reference_dir)
    assert StepCache(tmp_path, "k").load_reference(again, s.windows) and again._ram == {}
    model, tok = load_model(ckpt)
    resumed = evaluate_loaded(model, tok, settings=s, weights="int4-g32", progress=False, reference=again)
    assert fidelity(resumed) == fidelity(today)


def test_a_reference_missing_a_window_is_not_adopted(ckpt, tmp_path):
    s = EvalSettings(corpus=str(ckpt / "corpus.txt"), windows=2, window_len=40, tasks=("ppl",))
    cache = StepCache(tmp_path, "k")
    ref = reference_cache("m", s, directory=cache.reference_dir)
    ref.put_logits(0, torch.zeros(3, 5))
    ref.results["ppl"] = {"ppl": 1.0}
    cache.reference_path.write_text("{}")
    assert not cache.load_reference(reference_cache("m", s, directory=cache.reference_dir), 2)
