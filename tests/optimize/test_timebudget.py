"""--time-budget: estimates from the measurements before, skips what would end past the budget, says so."""

from __future__ import annotations

import pytest

from bytediet.errors import ConfigError
from bytediet.optimize import recipe as recipe_module
from bytediet.optimize.candidates import Candidate
from bytediet.optimize.recipe import Recipe
from bytediet.optimize.report import recommend, summary_markdown
from bytediet.optimize.timebudget import TimeBudget, kind_of, parse_duration
from tests.optimize.test_recipe import ckpt, options  # noqa: F401 - ckpt is a fixture


def test_durations_parse_and_bad_ones_say_what_to_give():
    assert (parse_duration("15m"), parse_duration("90s"), parse_duration("1.5h"), parse_duration("42")) == (
        900,
        90,
        5400,
        42,
    )
    assert parse_duration("none") is None
    with pytest.raises(ConfigError, match="15m"):
        parse_duration("soon")


def test_estimates_come_from_the_last_measurement_of_each_kind():
    t = TimeBudget(100.0)
    assert t.estimate("weights") is None and t.allows("weights")  # nothing to go by: measure
    t.record("baseline", 10.0)
    assert t.estimate("kv") == 10.0 and t.estimate("+gptq") == 30.0
    t.record("weights", 4.0)
    assert t.estimate("+awq") == 12.0
    t.start -= 90.0  # 90 s have passed
    assert t.allows("weights") and not t.allows("+awq") and t.allows("baseline")
    t.start -= 4.0  # 94 s: 4 s more would end inside the 3 % the budget keeps back
    assert not t.allows("weights") and t.allows("baseline")
    t.start += 4.0
    t.skip("w=int4+awq", "weights", "+awq")
    assert t.to_dict()["skipped"] == [{"label": "w=int4+awq", "step": "weights", "estimated_s": 12.0}]
    assert kind_of(Candidate("kv", kv="int8")) == "kv" and kind_of(Candidate("weights", "int4", method="awq")) == "+awq"
    assert kind_of(Candidate("kv", kv="auto:4.5")) == "kv-plan" and t.estimate("kv-plan") == 12.0  # calibrates first


def test_the_budget_skips_and_the_report_says_what(ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(TimeBudget, "estimate", lambda self, kind: 1e6 if kind == "kv" else 0.0)
    report = Recipe(options(ckpt, time_budget=600.0), tmp_path, progress=False).run()
    assert report["steps"]["kv"]["records"] == [] and report["steps"]["weights"]["records"]
    skipped = report["time_budget"]["skipped"]
    assert {s["step"] for s in skipped} == {"kv"} and len(skipped) == 2
    assert all("kv=int8" in s["label"] or "kv=turboquant3.5" in s["label"] for s in skipped)
    recommend(report)
    assert "**Time budget** (10 min) reached: not measured" in summary_markdown(report)


def test_a_budget_that_cannot_hold_the_baseline_is_a_clear_error(ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(recipe_module, "baseline_seconds", lambda profile, settings: 1e5)
    with pytest.raises(ConfigError, match=r"--time-budget 1.0 min cannot measure even the baseline: it needs about"):
        Recipe(options(ckpt, time_budget=60.0), tmp_path, progress=False).run()


def test_progress_without_a_terminal_is_plain_lines_with_the_time_left(capsys):
    from bytediet.progress import Bars

    with Bars(True, plain=True) as bars:
        bars.line("plan")
        with bars.spin("step 1/5: profiling"):
            pass
        assert list(bars.track(["a", "b"], "step 2/5: weight formats", eta=lambda i: 120.0 * (2 - i))) == ["a", "b"]
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "plan" and err[1] == "step 1/5: profiling ..." and err[2].startswith("step 1/5: profiling: done")
    assert err[3:] == [
        "step 2/5: weight formats: a (about 4 min left) [1/2]",
        "step 2/5: weight formats: b (about 2 min left) [2/2]",
    ]
