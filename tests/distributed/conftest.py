"""Tiny random-weights checkpoints on disk: tensor-parallel ranks load their shards from a path."""

from __future__ import annotations

import json

import pytest
import tokenizers
from safetensors.torch import save_file

from tests.conftest import hf_checkpoint_parts, model_from_state, random_state, tiny_config

# GQA shapes of the real models, at toy size: SmolLM2 (9 query heads over 3 KV heads) and Gemma-3 (one KV head)
TINY = {
    "llama": dict(num_heads=9, num_kv_heads=3, head_dim=8, hidden_size=48, intermediate_size=40, vocab_size=97),
    "gemma3": dict(num_heads=4, num_kv_heads=1, head_dim=8, hidden_size=32, intermediate_size=64),
    "qwen2": dict(num_heads=4, num_kv_heads=2, head_dim=8),
}


# Whole blocks of 32 on every tensor-parallel cut at size 2 (heads of 32, intermediate 128): the packed formats
BLOCKY = dict(num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=64, intermediate_size=128, vocab_size=96)


def write_hf_checkpoint(path, arch: str, seed: int = 0, shape: dict | None = None):
    """A Hugging Face directory (config.json, model.safetensors, a word-level tokenizer.json) → the model.
    ``shape``: the config's sizes (default ``TINY[arch]``)."""
    config = tiny_config(arch, **(TINY[arch] if shape is None else shape))
    state = random_state(config, seed=seed)
    cfg, hf_state = hf_checkpoint_parts(config, state, arch)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(path / "model.safetensors"))
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return model_from_state(config, state)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-checkpoints")
    return {arch: (root / arch, write_hf_checkpoint(root / arch, arch, seed=3)) for arch in TINY}


@pytest.fixture(scope="session")
def blocky_checkpoint(tmp_path_factory):
    """(path, model) of a llama whose every TP = 2 cut falls on whole blocks of 32."""
    path = tmp_path_factory.mktemp("tp-blocky") / "llama"
    return path, write_hf_checkpoint(path, "llama", seed=5, shape=BLOCKY)


def run_batch(llm, prompts, params) -> tuple[list[list[int]], int]:
    """Staggered arrival (a new request every other step) through ``llm.engine`` → (token ids, preemptions)."""
    engine, reqs = llm.engine, []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        reqs.append(engine.add_request(p, sp))
        if i % 2:
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_blocks == engine.block_manager.num_blocks
    return [list(r.output_token_ids) for r in reqs], engine.scheduler.num_preemptions
