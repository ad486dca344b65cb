"""bytediet tune's table: the measured winner is stored under this machine's key, read back by the next
process, ignored under another key, and obeyed by the native decode step (x4 or row tiles)."""

import time

import pytest
import torch

from bytediet.kernels import ops, tuning
from bytediet.kernels.cpu import build

pytestmark = pytest.mark.skipif(
    build.find_compiler() is None or not build.runnable_variants(), reason="no native kernels on this machine"
)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BYTEDIET_TUNE_CACHE", str(tmp_path / "tune"))
    tuning.forget()
    yield
    tuning.forget()


def test_the_faster_kernel_wins_and_the_table_round_trips(monkeypatch):
    lib = ops.native_library()
    slow_shape = (3, 8, 64)  # Q4_1, 8 rows of 64: make its x4 kernel the slow one
    real_x4 = ops.gemm_x4

    def slowed(gtype, packed, x, bias=None, activations="q8", variant=None):
        if (gtype, packed.shape[0], x.shape[-1]) == slow_shape:
            time.sleep(0.003)
        return real_x4(gtype, packed, x, bias, activations, variant)

    monkeypatch.setattr(ops, "gemm_x4", slowed)
    table = tuning.tune(
        lib, [slow_shape, (8, 12, 64), (14, 4, 256)], batches=(1, 3), repeats=3, spin_candidates=(0, 200)
    )
    assert table.kernel_for(3, 8, 64, 1) == "rows" and table.kernel_for(3, 8, 64, 3) == "rows"
    assert table.kernel_for(14, 4, 256, 1) is None  # Q6_K has one kernel: nothing to choose
    assert table.spin_us in (0, 200)
    path = table.save()
    assert path.parent == tuning.cache_dir()
    again = tuning.TuningTable.load(tuning.machine_key(lib.path, lib.bd_num_threads()))
    assert again.kernels == table.kernels and again.spin_us == table.spin_us
    assert tuning.TuningTable.load(tuning.machine_key(lib.path, lib.bd_num_threads() + 1)) is None  # other threads
    path.write_text("{not json")
    assert tuning.TuningTable.load(table.key) is None  # a corrupt file means: untuned


def test_the_decode_step_obeys_the_table(monkeypatch):
    from bytediet.models.native_decode import native_decoder
    from tests.models.test_native_decode import packed_model

    model = packed_model("llama")
    caches = model.new_caches(4, 16)
    assert native_decoder(model, caches).spec.layers[0].q.interleaved  # untuned: x4 wherever it exists
    lib = ops.native_library()
    q = model.model.layers[0].self_attn.q_proj
    table = tuning.TuningTable(
        tuning.machine_key(lib.path, lib.bd_num_threads()),
        {tuning.shape_key(3, q.out_features, q.in_features, 1): "rows"},
    )
    table.save()
    tuning.forget()
    model = packed_model("llama")
    spec = native_decoder(model, model.new_caches(4, 16)).spec
    assert not spec.layers[0].q.interleaved and spec.layers[0].gate.interleaved


def test_the_prefill_product_is_tuned_and_the_layer_obeys(monkeypatch):
    from bytediet.models.layers import Linear
    from bytediet.quant import get_weight_format

    if not ops.has_gemm_panel(3):
        pytest.skip("no AVX-512 VNNI panel kernel in this build")
    lib = ops.native_library()
    table = tuning.tune(lib, [(3, 8, 64)], batches=(1,), repeats=3, spin_candidates=(), prefill_rows=64)
    assert table.kernel_for(3, 8, 64, 64) in ("panel", "fp32")
    lin = Linear(256, 40)
    lin.set_weight(torch.randn(40, 256), get_weight_format("gguf-q4_1"))
    x = torch.randn(ops.DENSE_GEMM_MIN_ROWS, 256)
    calls = []
    real = ops.gemm_panel
    monkeypatch.setattr(ops, "gemm_panel", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(ops, "tuned_kernel", lambda *a, **k: "fp32")  # the table says: fp32 wins here
    exact = torch.nn.functional.linear(x, lin.dequantized_weight())
    assert torch.allclose(lin(x), exact, rtol=1e-5, atol=1e-4) and not calls
    monkeypatch.setattr(ops, "tuned_kernel", lambda *a, **k: None)  # untuned: the panel
    lin(x)
    assert calls


def test_apply_sets_the_tuned_spin():
    calls = []

    class FakeLib:
        path, bd_set_spin_us = "/nowhere/libbytediet-x.so", calls.append

        def bd_num_threads(self):
            return 2

    lib = FakeLib()
    assert tuning.apply(lib) is None and calls == [tuning.DEFAULT_SPIN_US]
    tuning.TuningTable(tuning.machine_key(lib.path, 2), spin_us=50).save()
    tuning.forget()
    assert tuning.apply(lib).spin_us == 50 and calls[-1] == 50
