"""Candidates come from the registries: every registered name is tried or skipped with a reason."""

from __future__ import annotations

import pytest

from bytediet.kvcache import KV_CODECS
from bytediet.optimize.candidates import REFERENCE_KV, REFERENCE_WEIGHTS, Candidate, kv_specs, weight_fits, weight_specs
from bytediet.quant import WEIGHT_FORMATS
from bytediet.quant.int8 import Int8
from tests.conftest import model_from_state, random_state, tiny_config


@pytest.fixture(scope="module")
def model():
    config = tiny_config("llama")  # hidden 32, intermediate 64, head_dim 8
    return model_from_state(config, random_state(config))


def _family(spec: str, names: list[str]) -> str:
    return max((n for n in names if spec.startswith(n)), key=len)


def test_every_registered_weight_format_is_tried_or_skipped_with_a_reason(model):
    out = weight_specs(model)
    names = WEIGHT_FORMATS.names()
    covered = {_family(s, names) for s in [*out.specs, *out.skipped]}
    assert covered == set(names) - set(REFERENCE_WEIGHTS)
    assert {"int8", "fp8", "nvfp4", "int4-g32"} <= set(out.specs)
    # hidden 32 is not a multiple of 64 or 128: those int4 groups are skipped, with the reason
    assert "int4-g64" in out.skipped and "does not divide" in out.skipped["int4-g64"]
    assert all(out.skipped.values())


def test_every_registered_kv_codec_is_tried_or_skipped(model):
    out = kv_specs(model)
    names = KV_CODECS.names()
    covered = {_family(s, names) for s in [*out.specs, *out.skipped]}
    assert covered == set(names) - set(REFERENCE_KV)
    assert {"int8", "fp8", "turboquant3.5"} <= set(out.specs)
    assert "smallest layout" in out.skipped["turboquant2.5"]  # head_dim 8 leaves no room for 2.5 bits
    # KIVI's 32-token key groups need 32-token blocks: the engine's default block size grows to fit them,
    # a fixed 16-token block rules kivi4 out (with the reason) but not kivi4g16
    assert {"kivi4", "kivi4g16"} <= set(out.specs)
    fixed = kv_specs(model, block_size=16)
    assert "must divide the KV block size 16" in fixed.skipped["kivi4"] and "kivi4g16" in fixed.specs


def test_a_newly_registered_format_joins_automatically(model, monkeypatch):
    class Int8Again(Int8):
        name = "int8again"

    monkeypatch.setitem(WEIGHT_FORMATS._items, "int8again", Int8Again)
    assert "int8again" in weight_specs(model).specs


def test_a_format_may_list_its_own_variants(model, monkeypatch):
    class Variants(Int8):
        name = "variants"

        @classmethod
        def candidate_specs(cls):
            return ("int8", "int4-g64")

    monkeypatch.setitem(WEIGHT_FORMATS._items, "variants", Variants)
    out = weight_specs(model, only=None)
    assert "int4-g64" in out.skipped


def test_quick_keeps_one_fitting_spec_per_family(model):
    w, kv = weight_specs(model, quick=True), kv_specs(model, quick=True)
    assert w.specs == ["int8", "int4-g32", "nvfp4", "sparse24"]  # int4-g128 and -g64 do not fit hidden 32
    assert kv.specs == ["int8", "turboquant3.5"]


def test_only_restricts_and_reports_unfit_specs(model):
    out = weight_specs(model, only=["int8", "int4-g128", "nope"])
    assert out.specs == ["int8"]
    assert set(out.skipped) == {"int4-g128", "nope"} and "unknown weight format" in out.skipped["nope"]


def test_weight_fits_checks_every_width(model):
    assert weight_fits("int4-g32", model) is None
    wide = model_from_state(
        tiny_config("llama", hidden_size=48, head_dim=12),
        random_state(tiny_config("llama", hidden_size=48, head_dim=12)),
    )
    assert "does not divide" in weight_fits("int4-g32", wide)


def test_candidate_labels_name_every_choice():
    c = Candidate("sensitive", "int4-g64", "int8", (("lm_head", "int8"),))
    assert c.label == "w=int4-g64 lm_head=int8 kv=int8"
    assert c.to_dict()["overrides"] == {"lm_head": "int8"}


def test_calibrated_specs_come_from_the_method_registry_on_the_rtn_grid(model):
    from bytediet.calibrate.base import calibration_method_names
    from bytediet.optimize.candidates import calibrated_specs

    rtn = weight_specs(model)
    out = calibrated_specs(model, rtn)
    methods = {s.split("+")[1] for s in out.specs}
    assert methods == set(calibration_method_names()) >= {"awq", "gptq", "smoothquant", "wanda"}
    assert {"int4-g32+awq", "int4-g32+gptq", "int8-w8a8+smoothquant", "sparse24+wanda"} <= set(out.specs)
    quick = calibrated_specs(model, weight_specs(model, quick=True), quick=True)
    assert quick.specs == ["int4-g32+awq", "sparse24+sparsegpt"]  # one method per family (the first by name)
    assert calibrated_specs(model, rtn, methods=("gptq",)).specs == ["int4-g32+gptq"]


def test_explicit_calibrated_specs_are_checked(model):
    from bytediet.optimize.candidates import Candidate, calibrated_specs

    out = calibrated_specs(model, weight_specs(model), only=["int4-g32+gptq", "int8+awq", "int4-g64+awq", "x+nope"])
    assert out.specs == ["int4-g32+gptq"]
    assert "calibrates int4, not int8" in out.skipped["int8+awq"]
    assert "does not divide" in out.skipped["int4-g64+awq"]
    assert "unknown calibration method" in out.skipped["x+nope"]
    cand = Candidate.for_weights("weights", "int4-g32+gptq")
    assert (cand.weights, cand.method, cand.label) == ("int4-g32", "gptq", "w=int4-g32+gptq kv=auto")


@pytest.mark.parametrize(
    "spec, variants",
    [
        ("int4-g32", ["int4-g32-a8", "int4-g32-af32"]),
        ("int8", ["int8-a8", "int8-af32"]),
        ("gguf-q4_1-a8", ["gguf-q4_1", "gguf-q4_1-af32"]),
        ("sparse24-int8", ["sparse24-int8-a8", "sparse24-int8-af32"]),
        ("int4-g64+awq", ["int4-g64-a8+awq", "int4-g64-af32+awq"]),  # the calibration method stays
        ("fp8", []),
        ("sparse24", []),  # float values: float activations only
        ("int8-w8a8", []),  # per-token int8 activations are the format
        ("fp32", []),
        ("no-such-format", []),
    ],
)
def test_activation_variants_of_a_weight_spec(spec, variants):
    from bytediet.optimize.candidates import activation_specs

    assert activation_specs(spec) == variants


def test_budgets_lead_the_kv_candidates_and_unreachable_ones_are_skipped(model):
    out = kv_specs(model, quick=True, budgets=(8.5, 6.0, 4.5, 3.5, 1.0))
    assert out.specs == ["auto:8.5", "auto:6", "auto:4.5", "auto:3.5", "int8", "turboquant3.5"]
    # head_dim 8: the cheapest plan candidate is turboquant3 (turboquant2/2.5 have no room), 3 bits all-in
    assert "auto:1 is below what any codec reaches" in out.skipped["auto:1"]
    only = kv_specs(model, only=["auto:4.5", "int8", "auto:x"], budgets=(6.0,))
    assert only.specs == ["auto:4.5", "int8"] and "bad KV budget" in only.skipped["auto:x"]
