"""Loading GGUF files and Hugging Face directories written here from tiny random models, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from bytediet.errors import CheckpointError
from bytediet.models.arch import unpermute_rope
from bytediet.models.loader import load_model
from tests.conftest import hf_checkpoint_parts, model_from_state, random_state, tiny_config

HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def permute_like_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (written independently of the loader's inverse)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(path, config, state, *, qtype=None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    for name, t in state.items():
        a = t.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, idx, rest = name.split(".", 3)
            mod, kind = rest.rsplit(".", 1)
            gname = f"blk.{idx}.{HF_TO_GGUF[mod]}.{kind}"
            if mod == "self_attn.q_proj":
                a = permute_like_llama_cpp(a, config.num_heads)
            if mod == "self_attn.k_proj":
                a = permute_like_llama_cpp(a, config.num_kv_heads)
        if qtype is not None and a.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def tiny_llama():
    config = tiny_config("llama", head_dim=8, num_heads=4, num_kv_heads=2)
    state = random_state(config, seed=11)
    return config, state, model_from_state(config, state)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.random.default_rng(0).normal(size=(4 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope(permute_like_llama_cpp(w, 4), 4), w)


def test_gguf_round_trip_undoes_the_qk_permutation(tmp_path, tiny_llama):
    config, state, model = tiny_llama
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path, config, state)
    loaded, tok = load_model(path, load_tokenizer=False)
    assert loaded.config.num_layers == 2 and loaded.config.tie_word_embeddings
    ids = torch.arange(20) % config.vocab_size
    torch.testing.assert_close(loaded.score(ids), model.score(ids), atol=1e-5, rtol=1e-5)


def test_gguf_quantized_tensors_dequantize_and_keep_their_type(tmp_path, tiny_llama):
    config, state, model = tiny_llama
    path = tmp_path / "tiny_q8.gguf"
    write_tiny_llama_gguf(path, config, state, qtype=gguf.GGMLQuantizationType.Q8_0)
    loaded, _ = load_model(path, load_tokenizer=False)
    assert loaded.source_types["model.layers.0.self_attn.q_proj.weight"] == "Q8_0"
    q8 = gguf.GGMLQuantizationType.Q8_0
    # Q8_0 blocks run along rows, so quantizing before or after the row permutation is the same
    rounded = {
        k: torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(v.numpy(), q8), q8)).reshape(v.shape)
        if v.ndim == 2
        else v
        for k, v in state.items()
    }
    expected = model_from_state(config, rounded)
    ids = torch.arange(16) % config.vocab_size
    torch.testing.assert_close(loaded.score(ids), expected.score(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_hf_directory_loads_single_and_sharded(tmp_path, arch):
    config = tiny_config(arch)
    state = random_state(config, seed=12)
    model = model_from_state(config, state)
    cfg, hf_state = hf_checkpoint_parts(config, state, arch)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    names = sorted(hf_state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: hf_state[k].contiguous() for k in keys}, str(tmp_path / fname))
    index = {"weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded, _ = load_model(tmp_path, load_tokenizer=False)
    ids = torch.arange(20) % config.vocab_size
    torch.testing.assert_close(loaded.score(ids), model.score(ids), atol=1e-5, rtol=1e-5)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_model(tmp_path / "nope.gguf")


def test_bad_magic_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(CheckpointError, match="bad magic"):
        load_model(bad)


def test_truncated_gguf_names_the_tensor(tmp_path, tiny_llama):
    config, state, _ = tiny_llama
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path, config, state)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 300])
    with pytest.raises(CheckpointError, match="truncated|corrupt"):
        load_model(cut, load_tokenizer=False)


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="unsupported architecture 'mamba'"):
        load_model(tmp_path / "mamba.gguf")


def test_mismatched_config_and_safetensors(tmp_path):
    config = tiny_config("llama")
    state = random_state(config)
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(7, config.hidden_size)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": config.vocab_size,
                "hidden_size": config.hidden_size,
                "intermediate_size": config.intermediate_size,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 8,
                "tie_word_embeddings": True,
            }
        )
    )
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="up_proj.*shape"):
        load_model(tmp_path, load_tokenizer=False)


def test_cli_reports_bad_checkpoint_in_one_line_with_exit_code_2(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(3))
    r = subprocess.run(
        [sys.executable, "-m", "bytediet.cli", "generate", "--model", str(bad), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.gguf" in lines[0] and "Traceback" not in r.stderr


def test_tensor_type_that_cannot_be_dequantized_names_tensor_and_type(tmp_path, tiny_llama):
    config, state, _ = tiny_llama
    q81 = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[q81]
    state = dict(state)
    up = state.pop("model.layers.0.mlp.up_proj.weight")
    path = tmp_path / "q81.gguf"
    write_tiny_llama_gguf(path, config, state)
    # rewrite with the up projection stored as Q8_1 raw blocks (the gguf package has no Q8_1 dequantizer)
    w = gguf.GGUFWriter(str(tmp_path / "q81b.gguf"), "llama")
    reader = gguf.GGUFReader(str(path))
    for key in (
        "block_count",
        "context_length",
        "embedding_length",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "rope.freq_base",
        "attention.layer_norm_rms_epsilon",
        "vocab_size",
    ):
        f = reader.fields[f"llama.{key}"]
        w.add_key_value(f"llama.{key}", f.contents(), f.types[0])
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    raw = np.zeros((up.shape[0], up.shape[1] // block * size), np.uint8)
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=q81)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="blk.0.ffn_up.weight.*Q8_1"):
        load_model(tmp_path / "q81b.gguf", load_tokenizer=False)


def test_load_as_engine_runs_keeps_quantized_blocks_only(tmp_path, tiny_llama):
    from bytediet.models.loader import load_as_engine_runs, native_block_types

    config, state, _ = tiny_llama
    quantized, plain = tmp_path / "q4_1.gguf", tmp_path / "f32.gguf"
    write_tiny_llama_gguf(quantized, config, state, qtype=gguf.GGMLQuantizationType.Q4_1)
    write_tiny_llama_gguf(plain, config, state)
    packed = load_as_engine_runs(quantized)
    linears = len(list(packed.linear_layers()))
    assert native_block_types(packed) == {"Q4_1": linears - 1}  # the tied lm_head is no checkpoint tensor
    assert {lin.format.spec() for name, lin in packed.linear_layers() if name != "lm_head"} == {"gguf-q4_1"}
    dequantized, _ = load_model(quantized, load_tokenizer=False)
    assert native_block_types(dequantized) == {"Q4_1": linears - 1}  # what it ships, whatever this load made
    assert {lin.format.spec() for _, lin in dequantized.linear_layers()} == {"fp32"}
    ids = torch.tensor([1, 5, 9, 2])
    torch.testing.assert_close(packed.score(ids), dequantized.score(ids), rtol=0.05, atol=0.05)
    assert load_as_engine_runs(plain) is None  # float blocks: the fp32 load is how the engine runs it


@pytest.mark.slow
def test_the_qwen_alias_assembles_the_chunk_packages_once():
    from bytediet.models.loader import load_config, resolve_model_path

    path = resolve_model_path("qwen2.5-0.5b")
    assert path.stat().st_size == 491400064 and path.read_bytes()[:4] == b"GGUF"
    assert resolve_model_path("Qwen2.5-Coder-0.5B") == path
    config = load_config("qwen2.5-0.5b")
    assert (config.architecture, config.num_layers, config.hidden_size) == ("qwen2", 24, 896)
