"""``auto:<bits>``'s per-channel key candidates (``k=kivi4g16``, ``k=kivi2g16``): key half only, bytes all-in, a plan
that uses them in the engine, and a known answer on keys with a per-channel offset."""

from __future__ import annotations

import pytest
import torch

from bytediet.calibrate.kv_budget import candidate_bytes, layer_errors
from bytediet.calibrate.kv_candidates import CHANNEL_KEY_CANDIDATES, DEFAULT_CANDIDATES, candidate_roles
from bytediet.errors import ConfigError
from bytediet.kvcache import get_kv_codec
from bytediet.kvcache.split import half_of
from tests.conftest import model_from_state, random_state, tiny_config
from tests.kvcache.test_native_pages import NATIVE, assert_staged_native_equals_own_read

H, D = 2, 64


def test_a_k_equals_candidate_offers_only_its_key_half():
    roles = candidate_roles(("q8_0", "k=kivi4g16", "v=q4_0", "k=q4_0", "k=q8_0,v=q4_0"))
    assert roles == {"q8_0": ("k", "v"), "kivi4g16": ("k",), "q4_0": ("k", "v"), "k=q8_0,v=q4_0": ("k", "v")}
    assert {"kivi4g16": ("k",), "kivi2g16": ("k",)}.items() <= candidate_roles(CHANNEL_KEY_CANDIDATES).items()
    assert not set(CHANNEL_KEY_CANDIDATES) & set(DEFAULT_CANDIDATES)  # opt-in: their plans decode on the module path
    with pytest.raises(ConfigError, match="k=<codec> or v=<codec>"):
        candidate_roles(("k=",))


@pytest.mark.parametrize("bits", [4, 2])
def test_per_channel_keys_cost_codes_scales_zeros_and_staging(bits):
    """Per token and KV head: D·b/8 code bytes, an fp16 scale and zero per channel per 16 tokens, the fp16 staging
    page of the open group (16 × D per 512 cache tokens); per token, two int32 per 16-token group. The same as the
    pages actually allocate per slot, so the block pool and the budget count what is stored."""
    nbytes = candidate_bytes((f"k=kivi{bits}g16",), H, D)
    assert nbytes["v"] == {}  # not a value candidate
    expected = H * (D * bits / 8 + 2 * 2 * D / 16 + 16 * D * 2 / 512) + 2 * 4 / 16
    assert nbytes["k"] == {f"kivi{bits}g16": pytest.approx(expected)}
    assert expected * 8 / (H * D) == pytest.approx(bits + 2.5 + 4 / (H * D))  # 6.53 / 4.53 bits at 2 × 64
    pages = half_of(get_kv_codec(f"kivi{bits}g16"), "k").create(0, "k", 64, 16, H, D, "cpu")  # 1024 slots
    assert sum(t.numel() * t.element_size() for t in pages.tensors()) / 1024 == pytest.approx(expected)


@pytest.mark.parametrize("seed", range(3))
def test_per_channel_keys_beat_per_token_codecs_of_more_bits_on_keys_with_a_channel_offset(seed):
    """Keys = a per-channel constant of RMS 50 (what an attention bias gives) + N(0, 1). The constant shifts every
    score of a query equally, so attention sees only the varying part. Per channel over 16 tokens, 4 bits step
    through that part's range (≈ 3.5σ): noise variance ≈ (3.5/15)²/12 ≈ 0.005. A per-token scale (q8_0, int8) spans
    the constant (max ≈ 125 over a block): step ≈ 1, noise ≈ 0.08, ~17× more at 8.25–8.5 bits (measured 19–24×), and
    4 bits per token would be ~250× more again. Asserted with a 4× margin: this fails if the candidate quantizes per
    token."""
    g = torch.Generator().manual_seed(1000 + seed)
    n, hq = 256, 4
    k = 50 * torch.randn(H, D, generator=g) + torch.randn(n, H, D, generator=g)
    sample = {"k": k, "v": torch.randn(n, H, D, generator=g), "q": torch.randn(n, hq, D, generator=g)}
    specs = ("kivi4g16", "q8_0", "int8", "q5_0")
    codecs = {s: get_kv_codec(s) for s in specs}
    err = layer_errors(sample, [n], codecs, 0, D**-0.5, None, {s: ("k",) for s in specs})["k"]
    assert err["kivi4g16"] < 0.25 * min(err["q8_0"], err["int8"])
    assert err["kivi4g16"] < 0.01 * err["q5_0"]  # the per-token codec nearest below its bits


def test_a_plan_with_per_channel_keys_round_trips_through_the_engine():
    """Per-channel keys beside block, rotated and (calibrated) TurboQuant values: measured as key candidates only, the
    plan travels as data, sizes the pool all-in and generates; which read runs each layer (native or the codec's)."""
    from bytediet import LLM
    from bytediet.calibrate.kv_budget import measure_errors
    from bytediet.kvcache.auto import BudgetCodec

    cfg = tiny_config("qwen2", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64, num_layers=3)
    model = model_from_state(cfg, random_state(cfg, seed=7))
    candidates = ("q4_0", "rot-q8_0", "turboquant4", "k=kivi4g16", "k=kivi2g16")
    windows = [torch.randint(0, cfg.vocab_size, (96,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    sens = measure_errors(model, windows, candidates)
    assert all(
        {"kivi4g16", "kivi2g16"} <= set(e["k"]) and not {"kivi4g16", "kivi2g16"} & set(e["v"]) for e in sens.errors
    )
    plan = [{"k": "kivi4g16", "v": "q4_0"}, {"k": "kivi2g16", "v": "rot-q8_0"}, {"k": "kivi4g16", "v": "turboquant4"}]
    state = {"budget": 6.5, "plan": plan, "states": sens.states(["turboquant4"])}
    llm = LLM(
        "tiny", loaded=(model, None), kv_cache_dtype="auto:6.5", kv_calibration_state=state, num_blocks=8, block_size=16
    )
    runner = llm.engine.runner
    nbytes = candidate_bytes(candidates, H, D)
    assert runner.bytes_per_token == pytest.approx(sum(nbytes["k"][p["k"]] + nbytes["v"][p["v"]] for p in plan))
    assert len(llm.generate([list(range(1, 41))])[0].outputs[0].token_ids) > 0
    codec = BudgetCodec(6.5)
    codec.load_calibration_state(state, rope=getattr(model, "rope", None))
    caches = [c.create_cache(i, 4, 16, H, D, torch.float32, "cpu") for i, c in enumerate(codec.layers)]
    assert [None if (p := c.attention_pages()) is None else p["k_dtype"] for c in caches] == [
        "kivi4-keys",  # read natively beside q4_0 values
        "kivi2-keys",  # and beside rot-q8_0's (the output rotated back)
        None,  # code-page keys beside TurboQuant values: the codec's blockwise read
    ]


@NATIVE
@pytest.mark.parametrize("spec", ["k=kivi4g16,v=q4_0", "k=kivi2g16,v=rot-q8_0", "k=kivi4g16,v=int8"])
@pytest.mark.parametrize("hq,hkv,d,window", [(9, 3, 64, None), (6, 2, 96, 7)])
def test_native_attention_on_a_plan_s_per_channel_key_layers_equals_the_codecs_own_read(spec, hq, hkv, d, window):
    """A plan's layer k=kivi<b>g16,v=<other>, in 16-token blocks with groups left open at every step: the native
    kernel's read (the reference twin forbidden) is the codec's own, to 1e-5 of the largest output."""
    assert_staged_native_equals_own_read(spec, 16, 4096, hq, hkv, d, window)


def test_a_plan_for_the_triton_path_never_takes_per_channel_keys(monkeypatch):
    """The Triton paged attention reads no code pages (its check_pages refuses kivi4-keys): on that path the
    allocator leaves KIVI's keys out, so the engine never refuses the plan it chose."""
    import bytediet.kernels.backend as backend
    from bytediet.calibrate.kv_budget import measure_errors

    cfg = tiny_config("llama", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64)
    model = model_from_state(cfg, random_state(cfg, seed=5))
    windows = [torch.randint(0, cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(3))]
    candidates = ("q4_0", "q8_0", "k=kivi4g16", "kivi2g16")
    monkeypatch.setattr(backend, "name_for", lambda device: "triton")
    sens = measure_errors(model, windows, candidates)
    assert all(set(e["k"]) == {"q4_0", "q8_0"} and set(e["v"]) == {"q4_0", "q8_0"} for e in sens.errors)
    monkeypatch.setattr(backend, "name_for", lambda device: "native")
    sens = measure_errors(model, windows, candidates)
    assert all(set(e["k"]) == {"q4_0", "q8_0", "kivi4g16", "kivi2g16"} for e in sens.errors)
    assert all(set(e["v"]) == {"q4_0", "q8_0", "kivi2g16"} for e in sens.errors)
