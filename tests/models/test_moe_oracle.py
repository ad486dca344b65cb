"""Mixtral, Qwen2-MoE and OLMoE loaded from tiny random checkpoints against transformers (the oracle).

Each checkpoint is written here (``save_pretrained`` and the ``gguf`` writer, see ``moe_checkpoints``):
logits must equal transformers' on the same weights, and 32 greedy tokens through the engine must equal
``generate``'s.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from bytediet.engine.llm import LLM
from bytediet.engine.params import SamplingParams
from bytediet.models.loader import load_model
from bytediet.models.tokenizer import load_tokenizer
from tests.models.moe_checkpoints import GGUF_VARIANTS, VARIANTS, write_gguf, write_hf

ATOL = 1e-4  # float32 throughout, like the dense oracle tests in test_transformer.py
PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12], [40, 1, 95], [7] * 6 + [50, 22, 64, 13, 29, 80, 91, 4, 38]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: on a busy machine OpenMP's per-op wake-up costs far more than the op (11 s against 0.3 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant → (HF directory, transformers model), written once per module."""
    root = tmp_path_factory.mktemp("moe")
    return {v: (root / v, write_hf(root / v, v)) for v in VARIANTS}


def hf_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def assert_logits_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_safetensors_logits_equal_transformers(checkpoints, variant):
    path, ref = checkpoints[variant]
    model, _ = load_model(path, load_tokenizer=False)
    assert model.config.num_experts == (
        ref.config.get_text_config().to_dict().get("num_local_experts") or ref.config.num_experts
    )
    for ids in PROMPTS:
        assert_logits_equal(model.score(torch.tensor(ids)), hf_logits(ref, ids))


@pytest.mark.parametrize("variant", GGUF_VARIANTS)
def test_gguf_logits_equal_transformers(checkpoints, variant, tmp_path):
    path, ref = checkpoints[variant]
    write_gguf(path, tmp_path / "tiny.gguf")
    model, _ = load_model(tmp_path / "tiny.gguf", load_tokenizer=False)
    assert model.config.num_experts and model.config.moe_gating
    for ids in PROMPTS:
        assert_logits_equal(model.score(torch.tensor(ids)), hf_logits(ref, ids))


def test_gguf_with_one_tensor_per_expert(checkpoints, tmp_path):
    """Mixtral GGUFs converted before llama.cpp stacked the experts name them ``ffn_gate.E`` etc."""
    path, ref = checkpoints["mixtral"]
    write_gguf(path, tmp_path / "old.gguf", stacked=False)
    model, _ = load_model(tmp_path / "old.gguf", load_tokenizer=False)
    assert model.config.architecture == "mixtral"
    assert_logits_equal(model.score(torch.tensor(PROMPTS[0])), hf_logits(ref, PROMPTS[0]))


@pytest.mark.parametrize("variant", GGUF_VARIANTS)
def test_llama_cpp_reads_the_test_gguf_like_transformers(checkpoints, variant, tmp_path):
    """The GGUF writer above follows llama.cpp's conventions (expert stacking, Mixtral's q/k permutation,
    1-D shared-expert gate, OLMoE's whole-projection q/k norm): llama.cpp itself agrees with transformers."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path, ref = checkpoints[variant]
    write_gguf(path, tmp_path / "tiny.gguf")
    ids = PROMPTS[0]
    llm = llama_cpp.Llama(str(tmp_path / "tiny.gguf"), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    llm.eval(ids)
    got = torch.tensor(np.array(llm.scores[: len(ids)]))
    assert (got - hf_logits(ref, ids)).abs().max() < 1e-2  # llama.cpp rounds some intermediates to f16


@pytest.mark.parametrize("variant", GGUF_VARIANTS)
def test_quantized_gguf_experts_run_on_their_packed_blocks(checkpoints, variant, tmp_path):
    """Stacked Q8_0 expert tensors are split per expert without dequantizing, and multiply exactly like
    their dequantized copy."""
    path, _ = checkpoints[variant]
    write_gguf(path, tmp_path / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    packed, _ = load_model(tmp_path / "q8.gguf", keep_packed=True, activations="f32", load_tokenizer=False)
    plain, _ = load_model(tmp_path / "q8.gguf", load_tokenizer=False)
    experts = [lin for name, lin in packed.linear_layers() if ".experts." in name]
    assert experts and all(lin.format.spec().startswith("gguf-q8_0") for lin in experts)
    ids = torch.tensor(PROMPTS[0])
    assert_logits_equal(packed.score(ids), plain.score(ids))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_32_tokens_equal_transformers_generate(checkpoints, variant):
    path, ref = checkpoints[variant]
    llm = LLM(str(path), kv_cache_memory="8MiB", max_num_seqs=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[
                0, len(ids) :
            ]
        assert out.outputs[0].token_ids == want.tolist()


def test_greedy_32_tokens_from_gguf_equal_transformers(checkpoints, tmp_path):
    path, ref = checkpoints["qwen2_moe"]
    write_gguf(path, tmp_path / "tiny.gguf")
    model, _ = load_model(tmp_path / "tiny.gguf", load_tokenizer=False)
    llm = LLM(loaded=(model, load_tokenizer(path)), kv_cache_memory="8MiB")
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))[0]
    with torch.no_grad():
        want = ref.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert out.outputs[0].token_ids == want[0, len(PROMPTS[0]) :].tolist()


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe"])
def test_weight_formats_apply_to_every_expert(checkpoints, variant):
    """``--weights int8`` quantizes each expert's linears like any other layer; routers stay in float."""
    path, ref = checkpoints[variant]
    full, _ = load_model(path, load_tokenizer=False)
    model, _ = load_model(path, weights="int8", load_tokenizer=False)
    experts = [name for name, lin in model.linear_layers() if ".experts." in name]
    assert len(experts) == 3 * model.config.num_experts * model.config.num_moe_layers
    assert all(lin.format.spec() == "int8" for name, lin in model.linear_layers() if name != "lm_head")
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32
    assert model.weight_bytes() < 0.45 * full.weight_bytes()
    ids = PROMPTS[0]
    got, want = model.score(torch.tensor(ids)), hf_logits(ref, ids)
    assert (got - want).abs().max() < 0.1 * want.abs().max()  # int8 rounding, not a wrong expert
