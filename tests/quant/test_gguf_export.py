"""GGUF export: write with gguf.GGUFWriter, read back with gguf.GGUFReader and compare every tensor."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from bytediet.calibrate.gguf_export import export_gguf, permute_rope_rows
from bytediet.errors import ConfigError
from bytediet.kernels.ggml_codecs import ENCODERS
from bytediet.models.quantize import QuantizeConfig, quantize

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 96
LINEARS = {
    "attn_q": (HEADS * 16, HIDDEN),
    "attn_k": (KV_HEADS * 16, HIDDEN),
    "attn_v": (KV_HEADS * 16, HIDDEN),
    "attn_output": (HIDDEN, HEADS * 16),
    "ffn_gate": (FFN, HIDDEN),
    "ffn_up": (FFN, HIDDEN),
    "ffn_down": (HIDDEN, FFN),
}


@pytest.fixture
def source_gguf(tmp_path):
    """A tiny llama GGUF in the llama.cpp layout (Q4_1 linears, F32 norms and embedding)."""
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "embedding_length": HIDDEN,
        "feed_forward_length": FFN,
        "block_count": LAYERS,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
        "vocab_size": VOCAB,
        "context_length": 128,
    }.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("general.name", "tiny")
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32))
    for i in range(LAYERS):
        for name, shape in LINEARS.items():
            blocks = gguf.quants.quantize(rng.standard_normal(shape, dtype=np.float32) * 0.1, T.Q4_1)
            w.add_tensor(f"blk.{i}.{name}.weight", blocks, raw_dtype=T.Q4_1)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", 1 + 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _load(path, keep_packed=True):
    from bytediet.models.loader import load_model

    model, _ = load_model(path, keep_packed=keep_packed, load_tokenizer=False)
    return model


def _tensors(path):
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def test_export_q8_0_reads_back_exactly(source_gguf, tmp_path):
    model = _load(source_gguf)
    quantize(model, QuantizeConfig(format="fp32", skip=("lm_head",)))  # float layers: exported by encoding
    out = export_gguf(model, source_gguf, tmp_path / "out.gguf", "Q8_0")
    src, back = _tensors(source_gguf), _tensors(out)
    assert set(back) == set(src)
    layers = dict(model.linear_layers())
    for name, t in back.items():
        part = name.split(".")[2] if name.startswith("blk.") else None
        if part in LINEARS:
            assert t.tensor_type == T.Q8_0
            module = f"model.layers.{name.split('.')[1]}." + {"attn": "self_attn.", "ffn": "mlp."}[part.split("_")[0]]
            module += {
                "attn_q": "q_proj",
                "attn_k": "k_proj",
                "attn_v": "v_proj",
                "attn_output": "o_proj",
                "ffn_gate": "gate_proj",
                "ffn_up": "up_proj",
                "ffn_down": "down_proj",
            }[part]
            w = layers[module].dequantized_weight()
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(part)
            if heads:  # llama.cpp's interleaved-RoPE row order
                w = torch.from_numpy(permute_rope_rows(w.numpy(), heads))
            expected = ENCODERS[T.Q8_0](w.reshape(-1, 32)).reshape(w.shape[0], -1).numpy()
            assert np.array_equal(np.asarray(t.data), expected), name
        else:  # embeddings and norms: the source bytes, unchanged
            assert t.tensor_type == src[name].tensor_type
            assert np.array_equal(np.asarray(t.data), np.asarray(src[name].data)), name
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0


def test_packed_gguf_layers_round_trip_through_the_loader(source_gguf, tmp_path):
    """Native Q4_1 layers are written as they are: the re-loaded model computes the same logits."""
    model = _load(source_gguf)
    quantize(model, QuantizeConfig(format="gguf-q4_0", skip=("lm_head", "*.mlp.*")))  # q/k/v/o → Q4_0; MLP stays Q4_1
    out = export_gguf(model, source_gguf, tmp_path / "out.gguf")
    back = _tensors(out)
    assert back["blk.0.attn_q.weight"].tensor_type == T.Q4_0 and back["blk.0.ffn_up.weight"].tensor_type == T.Q4_1
    again = _load(out)
    ids = torch.arange(10)
    assert torch.equal(again.score(ids), model.score(ids))


def test_non_gguf_layers_need_a_type(source_gguf, tmp_path):
    model = _load(source_gguf)
    quantize(model, QuantizeConfig(format="int8", skip=("lm_head",)))
    with pytest.raises(ConfigError, match="pass ggml_type"):
        export_gguf(model, source_gguf, tmp_path / "out.gguf")
    assert list(tmp_path.glob("*out.gguf*")) == []  # nothing half-written
