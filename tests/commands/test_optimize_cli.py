"""``bytediet optimize --device``: the flag parses and resolves into the run's options; ``--device cuda`` without a
GPU is one line on stderr and exit 2, before anything is loaded."""

from __future__ import annotations

import pytest
import torch

from bytediet.cli import build_parser, main
from bytediet.commands.optimize import options_from_args


def _args(*extra: str):
    return build_parser().parse_args(["optimize", "--model", "m", *extra])


def test_the_device_flag_parses_and_resolves_into_the_options():
    assert _args().device == "auto"
    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert options_from_args(_args()).device == here  # auto: cuda where torch sees a GPU
    assert options_from_args(_args("--device", "cpu")).device == "cpu"
    with pytest.raises(SystemExit):
        _args("--device", "tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_is_one_line_and_exit_2_before_loading(tmp_path, capsys, monkeypatch):
    import bytediet.models.loader as loader
    from bytediet.optimize.recipe import Recipe

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setattr(Recipe, "__init__", lambda *a, **k: pytest.fail("started a run"))
    assert main(["optimize", "--model", "default", "--out", str(tmp_path), "--device", "cuda", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--device cuda" in err and "no CUDA GPU" in err and "--device cpu" in err
