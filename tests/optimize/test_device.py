"""``optimize --device``: the device resolves and keys the cache; on the GPU code path (``BYTEDIET_BACKEND=triton``,
the Triton kernels in the interpreter) a candidate with no GPU kernel is skipped with the reason and the rest is
measured as the native path measures it; the GPU's memory is checked before loading; a real GPU runs it too."""

from __future__ import annotations

import pytest
import torch

from bytediet.errors import ConfigError
from bytediet.kernels import backend
from bytediet.optimize import device
from bytediet.optimize.recipe import OptimizeOptions, Recipe
from tests.optimize.test_recipe import options

NO_GPU = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.eval.test_harness import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-device"))


def test_auto_resolves_to_where_torch_sees_a_gpu_and_cpu_stays_cpu():
    assert OptimizeOptions().resolved().device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert OptimizeOptions(device="cpu").resolved().device == "cpu"
    with pytest.raises(ConfigError, match="device must be one of"):
        OptimizeOptions(device="tpu").resolved()


@pytest.mark.skipif(not NO_GPU, reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_before_anything_is_loaded(ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(Recipe, "_load", lambda self: pytest.fail("loaded before the device was checked"))
    with pytest.raises(ConfigError, match="sees no CUDA GPU") as e:
        Recipe(options(ckpt, device="cuda"), tmp_path, progress=False).run()
    assert "\n" not in str(e.value)


def test_the_cache_key_differs_by_device(ckpt, tmp_path, monkeypatch):
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    keys = {}
    for name, env in (("cpu", "auto"), ("triton", "triton")):
        monkeypatch.setenv(backend.BACKEND_ENV, env)
        recipe = Recipe(options(ckpt, device="cpu"), tmp_path, progress=False)
        recipe._load()
        keys[name] = recipe.key
    assert keys["cpu"] != keys["triton"]
    assert device.device_key("cpu") == "cpu:triton"  # the switch is still set
    monkeypatch.setenv(backend.BACKEND_ENV, "auto")
    assert device.device_key("cpu") is None  # the native CPU path keeps the keys runs had before --device
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert device.device_key("cuda") == "cuda:NVIDIA H200"  # one GPU's numbers are not another's


def test_the_gpu_memory_check_refuses_a_checkpoint_the_gpu_cannot_hold(ckpt, tmp_path, monkeypatch):
    """On CUDA the checkpoint is checked against the GPU's free memory (after the CPU plan), in one line, before
    anything is loaded; on the CPU nothing is checked."""
    assert device.check_gpu_memory(str(ckpt), "cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1000, 4000))
    monkeypatch.setattr(Recipe, "_load", lambda self: pytest.fail("loaded before the GPU memory check"))
    with pytest.raises(ConfigError, match=r"needs about .* GB on the GPU and Fake GPU has 0.0 GB free") as e:
        Recipe(options(ckpt, device="cuda"), tmp_path, progress=False).run()
    assert "\n" not in str(e.value) and "--device cpu" in str(e.value)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (10**12, 2 * 10**12))
    fits = device.check_gpu_memory(str(ckpt), "cuda")
    assert fits["gpu"] == "Fake GPU" and 0 < fits["model_bytes"] < fits["free_bytes"]


@pytest.fixture
def triton_backend(monkeypatch):
    pytest.importorskip("triton", reason="the Triton backend needs triton (the test extra)")
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")


def test_objection_names_what_has_no_gpu_kernel(ckpt, triton_backend):
    from bytediet.models.loader import load_model
    from bytediet.models.quantize import quantize

    model, _ = load_model(str(ckpt), dtype=torch.float32)
    assert device.objection(model, "int8") is None
    assert "kivi4" in device.objection(model, "kivi4") and "no GPU attention kernel" in device.objection(model, "kivi4")
    quantize(model, "sparse50")
    assert "sparse50" in device.objection(model, "auto")


# the candidates of the GPU-path run: int8 weights and int8 KV have Triton kernels, sparse50 and kivi4 have none
DEVICE_RUN = dict(weights=("int8", "sparse50"), kv=("int8", "kivi4"), kv_budgets=(), methods=())


def _run(ckpt, out, **kw) -> dict:
    return Recipe(options(ckpt, **DEVICE_RUN, **kw), out, progress=False).run()


def _records(report: dict) -> dict:
    return {r["label"]: r for s in ("baseline", "weights", "kv") for r in report["steps"][s]["records"]}


def test_the_gpu_code_path_skips_what_has_no_kernel_and_measures_the_rest_as_the_cpu(ckpt, tmp_path, monkeypatch):
    """``BYTEDIET_BACKEND=triton``: every model, engine and calibration of the run takes the GPU path (the Triton
    kernels, in the interpreter); sparse50 and kivi4 are skipped with the reason, not run on a slow path; the rest
    gives the native path's accuracy."""
    pytest.importorskip("triton", reason="the Triton backend needs triton (the test extra)")
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    native = _run(ckpt, tmp_path / "native", device="cpu")
    assert native["device"]["backend"] == "native" and native["device"]["skipped"] == []
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    calls = []
    attention = backend.attention_over_pages
    monkeypatch.setattr(backend, "attention_over_pages", lambda *a, **k: calls.append(1) or attention(*a, **k))
    report = _run(ckpt, tmp_path / "triton", device="cpu")
    assert report["device"]["backend"] == "triton" and calls  # the Triton attention ran
    skipped = {s["label"]: s["reason"] for s in report["device"]["skipped"]}
    assert set(skipped) == {"w=sparse50 kv=auto", "w=as loaded kv=kivi4"}
    assert "sparse50" in skipped["w=sparse50 kv=auto"] and "kivi4" in skipped["w=as loaded kv=kivi4"]
    assert report["steps"]["activations"]["note"].startswith("skipped on cpu: the activation precision")
    ran, cpu = _records(report), _records(native)
    assert set(ran) == {"w=as loaded kv=auto", "w=int8 kv=auto", "w=as loaded kv=int8"}
    for label, rec in ran.items():
        assert rec["ppl"] == pytest.approx(cpu[label]["ppl"], rel=1e-3), label
    from bytediet.optimize.report import recommend, summary_markdown

    recommend(report)
    assert "Not runnable on cpu" in summary_markdown(report)
    measured_on = report["recommendation"]["run_config"]["notes"]["measured_on"]
    assert measured_on["backend"] == "triton" and measured_on["device"] == "cpu"  # the run config says where
    again = _run(ckpt, tmp_path / "triton", device="cpu")  # resumed from the cache: the skips are listed again
    assert again["device"]["skipped"] == report["device"]["skipped"]


def test_a_build_that_fails_on_the_device_is_skipped_with_the_reason(ckpt, tmp_path, triton_backend, monkeypatch):
    real = Recipe.build

    def build(self, cand):
        if cand.weights == "int8":
            raise NotImplementedError("aten::fake_op has no CUDA kernel\nmore lines")
        return real(self, cand)

    monkeypatch.setattr(Recipe, "build", build)
    report = Recipe(
        options(ckpt, weights=("int8",), kv=(), kv_budgets=(), methods=(), device="cpu"), tmp_path, progress=False
    ).run()
    (skip,) = report["device"]["skipped"]
    assert skip["label"] == "w=int8 kv=auto" and "NotImplementedError: aten::fake_op" in skip["reason"]
    assert "\n" not in skip["reason"]


@pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU")
def test_a_run_on_the_gpu_measures_there_and_skips_what_has_no_kernel(ckpt, tmp_path):
    report = _run(ckpt, tmp_path, device="cuda")
    assert report["device"]["device"] == "cuda" and report["device"]["gpu_memory"]["free_bytes"] > 0
    assert {s["label"] for s in report["device"]["skipped"]} == {"w=sparse50 kv=auto", "w=as loaded kv=kivi4"}
    assert report["options"]["device"] == "cuda"
    assert _records(report)["w=int8 kv=auto"]["kl_mean"] > 0


def test_a_checkpoint_the_gpu_path_cannot_run_is_refused_in_one_line(ckpt, tmp_path, triton_backend, monkeypatch):
    import bytediet.optimize.recipe as recipe

    monkeypatch.setattr(recipe, "objection", lambda model, kv: "weight format gguf-q2_k (lm_head) has no GPU kernel")
    with pytest.raises(ConfigError, match=r"the checkpoint as loaded cannot run there \(weight format gguf-q2_k") as e:
        Recipe(options(ckpt, device="cpu"), tmp_path, progress=False).run()
    assert "\n" not in str(e.value)
