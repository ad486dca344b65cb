"""The two real checkpoints against Hugging Face transformers (the oracle) and known perplexities.

SmolLM2-135M-Instruct (Q4_1 GGUF) and Gemma-3-270M (Q4_K_M GGUF), float32. The oracle loads the same
GGUF with ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``.
"""

from __future__ import annotations

import pytest
import torch

from bytediet.eval.corpus import load_corpus
from bytediet.eval.fidelity import mean_nll
from bytediet.models.loader import default_model_path, gemma_model_path

MODELS = {"smollm2": default_model_path, "gemma3": gemma_model_path}


@pytest.fixture(scope="module")
def pride() -> str:
    text = load_corpus("prideprejudice")
    assert text.startswith("PRIDE AND PREJUDICE\n\nBy Jane Austen")
    return text


def oracle(path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
    ).eval()


def oracle_prompts(tokenizer, pride: str, bos: bool) -> list[list[int]]:
    prose = tokenizer.encode(pride[5000:12000], add_special_tokens=False)[:512]
    code = tokenizer.encode(
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint(fib(20))", add_special_tokens=False
    )
    short = tokenizer.encode("The memory wall: why moving bytes costs more than arithmetic.", add_special_tokens=False)
    start = [tokenizer.bos_token_id] if bos else []
    return [start + p for p in (prose, code, short)]


@pytest.mark.parametrize("name", ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_logits_match_transformers(name, pride, request):
    model, tokenizer = request.getfixturevalue(name)
    ref = oracle(MODELS[name]())
    prompts = oracle_prompts(tokenizer, pride, bos=(name == "gemma3"))
    assert len(prompts[0]) >= 512
    for ids in prompts:
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0].float()
        got = model.score(torch.tensor(ids))
        assert (got - expected).abs().max().item() <= 1e-2
        top2 = expected.topk(2, dim=-1)
        differ = got.argmax(-1) != top2.indices[:, 0]
        gaps = (top2.values[:, 0] - top2.values[:, 1])[differ]
        assert bool((gaps < 1e-3).all()), f"top-1 differs at non-tied positions: gaps {gaps.tolist()}"


def test_smollm2_perplexity_on_pride_and_prejudice(smollm2, pride):
    """First 512 tokens, no BOS, mean NLL of the 511 next-token predictions = 2.781 (PPL ≈ 16.1)."""
    model, tokenizer = smollm2
    ids = torch.tensor(tokenizer.encode(pride, add_special_tokens=False)[:512])
    logits = model.score(ids)
    nll = mean_nll(logits[:-1], ids[1:])
    assert abs(nll - 2.781) <= 0.01, nll


@pytest.mark.slow
def test_gemma3_perplexity_on_pride_and_prejudice(gemma3, pride):
    """BOS followed by the first 511 tokens: mean NLL = 2.796."""
    model, tokenizer = gemma3
    ids = torch.tensor([tokenizer.bos_token_id] + tokenizer.encode(pride, add_special_tokens=False)[:511])
    logits = model.score(ids)
    nll = mean_nll(logits[:-1], ids[1:])
    assert abs(nll - 2.796) <= 0.01, nll


def test_wrong_rope_layout_would_be_caught(pride):
    """Feeding llama.cpp's stored (interleaved) q/k to rotate-half RoPE ruins perplexity (≈ 175, not ≈ 16)."""
    from bytediet.models.loader import load_model
    from bytediet.quant import get_weight_format

    model, tokenizer = load_model("default")
    ids = torch.tensor(tokenizer.encode(pride, add_special_tokens=False)[:256])
    good = mean_nll(model.score(ids)[:-1], ids[1:])
    for layer in model.model.layers:  # put back the converter's permutation, as a loader that forgot to undo it
        for name, heads in (("q_proj", model.config.num_heads), ("k_proj", model.config.num_kv_heads)):
            lin = getattr(layer.self_attn, name)
            w = lin.dequantized_weight()
            d = w.shape[0] // heads
            permuted = w.reshape(heads, 2, d // 2, -1).transpose(1, 2).reshape(w.shape)
            lin.set_weight(permuted.contiguous(), get_weight_format("fp32"))
    bad = mean_nll(model.score(ids)[:-1], ids[1:])
    assert good < 3.0 and bad > good + 1.5, (good, bad)


def test_loading_smollm2_keeps_peak_rss_under_twice_the_weights():
    """Peak RSS growth while loading (measured in a fresh process) stays under 2× the loaded weights."""
    import subprocess
    import sys

    code = (
        "import resource, torch, bytediet.models.loader as L, bytediet.models.tokenizer, gguf, tokenizers;"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024;"
        "m, _ = L.load_model('default');"
        "print(m.weight_bytes(), base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    weights, base, peak = map(int, out.stdout.split())
    assert peak - base < 2 * weights, (weights, base, peak)
