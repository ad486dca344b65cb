"""The evaluation harness on a tiny random checkpoint (HF directory written here) and, once, the real model."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bytediet.errors import ConfigError
from bytediet.eval.fidelity import kl_per_position, token_nll, top1_agreement
from bytediet.eval.harness import EvalSettings, ReferenceCache, evaluate, evaluate_loaded, reference_cache
from bytediet.eval.tasks import EVAL_TASKS, FidelityTask
from bytediet.kvcache import get_kv_codec
from bytediet.models.loader import load_model
from bytediet.models.quantize import QuantizeConfig, quantize
from tests.conftest import random_state, tiny_config

_WORDS = (
    "the of and to her a in was it she not that be he had you his with as for but is have my all so which "
    "very no would could Elizabeth Darcy Jane Bingley sister mother letter house ball said replied "
    "never being such every little time much must more than what herself himself"
).split()


def tiny_text(n_words: int = 5000, seed: int = 0) -> str:
    """Seeded pseudo-prose: sentences of common words, paragraphs separated by blank lines."""
    rng = random.Random(seed)
    out, sentence = [], []
    for _ in range(n_words):
        sentence.append(rng.choice(_WORDS))
        if len(sentence) >= rng.randint(6, 16):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
            if rng.random() < 0.15:
                out.append("\n\n")
    return " ".join(out).replace(" \n\n ", "\n\n")


def write_tiny_checkpoint(path: Path, seed: int = 0, max_len: int = 512) -> Path:
    """A llama-family Hugging Face directory with random weights and a byte-level BPE trained on tiny_text;
    also ``corpus.txt`` (the training text) for ``--corpus``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    text = tiny_text(seed=seed)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text], trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    config = tiny_config("llama", vocab_size=tok.get_vocab_size(), max_position_embeddings=max_len)
    save_file({k: v.contiguous() for k, v in random_state(config, seed).items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": config.vocab_size,
                "hidden_size": config.hidden_size,
                "intermediate_size": config.intermediate_size,
                "num_hidden_layers": config.num_layers,
                "num_attention_heads": config.num_heads,
                "num_key_value_heads": config.num_kv_heads,
                "head_dim": config.head_dim,
                "rms_norm_eps": config.rms_norm_eps,
                "rope_theta": config.rope_theta,
                "max_position_embeddings": max_len,
                "tie_word_embeddings": True,
            }
        )
    )
    (path / "corpus.txt").write_text(text)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"))


def settings(ckpt: Path, **kw) -> EvalSettings:
    base = dict(corpus=str(ckpt / "corpus.txt"), windows=3, window_len=48, tasks=("ppl",), seed=1)
    return EvalSettings(**{**base, **kw})


def run(ckpt: Path, **kw) -> dict:
    opts = {k: kw.pop(k) for k in ("weights", "kv_cache_dtype", "reference") if k in kw}
    model, tok = load_model(ckpt)
    return evaluate_loaded(model, tok, settings=settings(ckpt, **kw), progress=False, **opts)


def test_every_kind_of_task_is_registered():
    assert {"ppl", "passkey", "speed"} <= set(EVAL_TASKS.names())


@pytest.mark.parametrize("kv", [None, "fp32"])
def test_identical_config_gives_zero_kl_and_full_agreement(ckpt, kv):
    r = run(ckpt, kv_cache_dtype=kv)["tasks"]["ppl"]
    assert r["kl"]["max"] == 0.0 and r["kl"]["mean"] == 0.0
    assert r["top1_agreement"] == 1.0
    assert r["test"]["ppl"] == r["reference"]["ppl"] and r["ppl_ratio"] == 1.0
    assert r["kl_histogram"]["below"] == r["kl"]["count"] == 3 * 47


def _independent(ckpt: Path, s: EvalSettings, weights=None, kv="auto"):
    """Per-window (ref, test) logits computed here, without the harness."""
    from bytediet.eval.corpus import load_corpus, make_windows

    ref_model, tok = load_model(ckpt)
    test_model, _ = load_model(ckpt)
    if weights:
        quantize(test_model, QuantizeConfig(format=weights))
    ids = tok.encode(load_corpus(s.corpus), add_special_tokens=False)
    for w in make_windows(ids, s.window_len, s.windows, seed=s.seed):
        yield ref_model.score(w.ids)[:-1], test_model.score(w.ids, kv_codec=kv)[:-1], w.ids[1:]


@pytest.mark.parametrize("weights,kv", [("int4-g32", None), (None, "int8")])
def test_compressed_config_matches_an_independent_computation(ckpt, weights, kv):
    r = run(ckpt, weights=weights, kv_cache_dtype=kv)["tasks"]["ppl"]
    kls, nll_ref, nll_test, agree = [], [], [], []
    for ref, test, targets in _independent(ckpt, settings(ckpt), weights, kv or "auto"):
        kls.append(kl_per_position(ref, test))
        nll_ref.append(token_nll(ref, targets))
        nll_test.append(token_nll(test, targets))
        agree.append(top1_agreement(ref, test) * len(targets))
    kl = torch.cat(kls)
    assert r["kl"]["mean"] > 0 and r["kl"]["max"] > r["kl"]["p50"]
    assert r["kl"]["mean"] == pytest.approx(float(kl.mean()), rel=1e-9)
    assert r["kl"]["max"] == pytest.approx(float(kl.max()), rel=1e-9)
    assert r["reference"]["ppl"] == pytest.approx(math.exp(float(torch.cat(nll_ref).mean())), rel=1e-9)
    assert r["test"]["ppl"] == pytest.approx(math.exp(float(torch.cat(nll_test).mean())), rel=1e-9)
    assert r["top1_agreement"] == pytest.approx(sum(agree) / len(kl))
    assert sum(r["kl_histogram"]["counts"]) + r["kl_histogram"]["below"] == len(kl)
    worst = [w["mean_kl"] for w in r["worst"]]
    assert worst == sorted(worst, reverse=True) and worst[0] == max(w["mean_kl"] for w in r["per_window"])


def test_reference_cache_is_reused_without_rerunning_the_reference(ckpt, monkeypatch):
    s = settings(ckpt)
    model, tok = load_model(ckpt)
    cache = reference_cache(model.source_path, s)
    first = evaluate_loaded(model, tok, settings=s, weights="int8", progress=False, reference=cache)

    def boom(*args, **kwargs):
        raise AssertionError("the reference was measured again")

    monkeypatch.setattr(FidelityTask, "measure_reference", boom)
    model, tok = load_model(ckpt)
    again = evaluate_loaded(model, tok, settings=s, weights="int8", progress=False, reference=cache)
    assert again["tasks"]["ppl"] == first["tasks"]["ppl"]
    model, tok = load_model(ckpt)
    kv = evaluate_loaded(model, tok, settings=s, kv_cache_dtype="int8", progress=False, reference=cache)
    assert kv["tasks"]["ppl"]["reference"] == first["tasks"]["ppl"]["reference"]
    assert kv["tasks"]["ppl"]["kl"]["mean"] > 0


def test_reference_cache_spills_to_disk_and_cleans_up():
    cache = ReferenceCache(key="k", max_memory_bytes=3 * 4 * 10)
    tensors = [torch.randn(3, 10) for _ in range(3)]
    for i, t in enumerate(tensors):
        cache.put_logits(i, t)
    assert cache.spilled == 2 and cache.has_logits(3) and not cache.has_logits(4)
    for i, t in enumerate(tensors):
        assert torch.equal(cache.logits(i), t)
    spill_dir = cache._dir
    cache.close()
    assert not spill_dir.exists()
    with pytest.raises(KeyError, match="window 1"):
        cache.logits(1)


def test_mismatched_reference_is_refused(ckpt):
    model, tok = load_model(ckpt)
    cache = reference_cache(model.source_path, settings(ckpt))
    with pytest.raises(ConfigError, match="another model or other settings"):
        evaluate_loaded(model, tok, settings=settings(ckpt, window_len=32), progress=False, reference=cache)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"window_len": 600}, "exceeds the model's context"),
        ({"tasks": ("nope",)}, "unknown eval task"),
        ({"weights": "int3-nope"}, "int3-nope"),
        ({"kv_cache_dtype": "nope"}, "nope"),
    ],
)
def test_bad_input_fails_before_any_work(ckpt, kw, match):
    with pytest.raises((ConfigError, KeyError, ValueError), match=match):
        run(ckpt, **kw)


def test_speed_task_reports_bytes_from_the_model_and_the_codec(ckpt):
    r = run(ckpt, tasks=("speed",), kv_cache_dtype="int8", weights="int8", speed_new_tokens=6)["tasks"]["speed"]
    fresh, _ = load_model(ckpt)
    cfg = fresh.config
    assert r["reference"]["weight_bytes"] == fresh.weight_bytes()
    quantize(fresh, QuantizeConfig(format="int8"))
    assert r["test"]["weight_bytes"] == fresh.weight_bytes() < r["reference"]["weight_bytes"]
    assert r["reference"]["kv_bytes_per_token"] == 2 * cfg.num_kv_heads * cfg.head_dim * 4 * cfg.num_layers
    int8 = get_kv_codec("int8").bytes_per_token(cfg.num_kv_heads, cfg.head_dim) * cfg.num_layers
    assert r["test"]["kv_bytes_per_token"] == int8 < r["reference"]["kv_bytes_per_token"]
    assert r["test"]["new_tokens"] == 6 and r["test"]["decode_tok_s"] > 0 and r["test"]["peak_rss_bytes"] > 0
    assert r["decode_speedup"] == pytest.approx(r["test"]["decode_tok_s"] / r["reference"]["decode_tok_s"])


def test_real_model_int8_weights_two_windows():
    """SmolLM2-135M, 2 windows x 128 tokens of Pride and Prejudice: int8 weights move KL a little."""
    r = evaluate("default", weights="int8", windows=2, window_len=128, tasks=("ppl",), progress=False)
    fid = r["tasks"]["ppl"]
    assert 5 < fid["reference"]["ppl"] < 100  # a 135M model on Austen
    assert 0 < fid["kl"]["mean"] < 0.05 and fid["top1_agreement"] > 0.85
    assert abs(math.log(fid["ppl_ratio"])) < 0.05


def test_real_gguf_as_loaded_runs_its_native_blocks():
    """Without --weights, the test is the GGUF as the engine runs it (Q4_1 blocks natively, Q8_0 head), not its
    fp32 dequantization: same values within the activation rounding, the bytes and the speed of the blocks."""
    r = evaluate(
        "default",
        windows=1,
        window_len=64,
        tasks=("ppl", "speed"),
        progress=False,
        settings=EvalSettings(windows=1, window_len=64, tasks=("ppl", "speed"), speed_new_tokens=4),
    )
    assert set(r["config"]["native_blocks"]) >= {"Q4_1"} and r["config"]["weights"] is None
    fid, speed = r["tasks"]["ppl"], r["tasks"]["speed"]
    assert 0 <= fid["kl"]["mean"] < 1e-3 and fid["top1_agreement"] > 0.95  # q16 activations: near exact
    assert speed["weight_ratio"] < 0.3  # 4.5-bit blocks against the fp32 reference
