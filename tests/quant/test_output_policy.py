"""Default output-layer policy: lm_head (the tied embedding) stays at int8, or as is for >= 8-bit formats."""

from __future__ import annotations

import pytest

from bytediet.errors import ConfigError
from bytediet.models.quantize import QuantizeConfig, quantize


@pytest.mark.parametrize(
    "fmt, lm_head",
    [
        ("int4-g32", "int8"),
        ("nvfp4", "int8"),
        ("mxfp4", "int8"),
        ("int8", None),
        ("fp8", None),
        ("int8-w8a8", None),
        ("bf16", None),
    ],
)
def test_lm_head_default(fmt, lm_head):
    assert QuantizeConfig(format=fmt).spec_for("lm_head") == lm_head
    assert QuantizeConfig(format=fmt).spec_for("model.layers.0.mlp.up_proj") == fmt


def test_user_choice_wins_and_policy_same_quantizes_it(tiny_model):
    assert QuantizeConfig(format="int4-g32", overrides={"lm_head": "nvfp4"}).spec_for("lm_head") == "nvfp4"
    assert QuantizeConfig(format="int4-g32", overrides={"*": "fp8"}).spec_for("lm_head") == "fp8"
    assert QuantizeConfig(format="int4-g32", skip=("lm_*",)).spec_for("lm_head") is None
    assert QuantizeConfig(format="int4-g32", output_policy="same").spec_for("lm_head") == "int4-g32"
    summary = quantize(tiny_model, "int4-g32")
    formats = {layer.name: layer.format for layer in summary.layers}
    assert formats["lm_head"] == "int8" and formats["model.layers.0.self_attn.q_proj"] == "int4-g32"
    with pytest.raises(ConfigError, match="output_policy"):
        QuantizeConfig(format="int8", output_policy="keep")


def test_round_trip_and_configs_saved_before_the_policy():
    cfg = QuantizeConfig(format="int4-g64", output_policy="same")
    assert QuantizeConfig.from_dict(cfg.to_dict()) == cfg
    old = {"format": "int4-g64", "overrides": {}, "skip": [], "calibration": None}
    assert QuantizeConfig.from_dict(old).spec_for("lm_head") == "int4-g64"
