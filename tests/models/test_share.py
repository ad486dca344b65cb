"""shared_copy: a configuration quantized layer by layer from the loaded blocks equals quantizing the fp32 load."""

from __future__ import annotations

import gguf
import pytest
import torch

from bytediet.models.loader import load_model, set_activations
from bytediet.models.quantize import QuantizeConfig, linear_layers, quantize
from bytediet.models.share import float_layers_as_loaded, shared_copy, shared_tensors
from bytediet.quant.base import get_weight_format
from tests.conftest import random_state, tiny_config
from tests.models.test_loader import write_tiny_llama_gguf


def tiny_gguf(path, qtype=gguf.GGMLQuantizationType.Q8_0):
    config = tiny_config("llama")
    write_tiny_llama_gguf(path, config, random_state(config, seed=5), qtype=qtype)
    return path


def loads(path):
    """(the fp32 load, the load as the engine runs it: blocks packed)."""
    fp32, _ = load_model(path, load_tokenizer=False)
    packed, _ = load_model(path, keep_packed=True, load_tokenizer=False)
    return fp32, packed


def packed_state(model) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": t for n, lin in linear_layers(model) for k, t in lin.packed.items()}


def assert_same_weights(a, b, kept=()) -> None:
    """Every layer of ``a`` and ``b`` packed to the same bytes; ``kept``: layers ``b`` keeps in the checkpoint's
    blocks at float activations where ``a`` holds float32 — the same float weights."""
    layers_b = dict(linear_layers(b))
    for name, layer in linear_layers(a):
        other = layers_b[name]
        if name in kept and other.format.spec() != "fp32":
            assert other.format.activations == "f32", name
            assert torch.equal(layer.dequantized_weight(), other.dequantized_weight()), name
            continue
        sa, sb = layer.packed, other.packed
        assert sa.keys() == sb.keys(), name
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), f"{name}.{k}"


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0])
@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "nvfp4", "sparse24"])
def test_layer_by_layer_from_the_blocks_equals_the_whole_fp32_model(tmp_path, qtype, fmt):
    fp32, packed = loads(tiny_gguf(tmp_path / "m.gguf", qtype))
    assert {lin.format.spec() for _, lin in packed.linear_layers()} != {"fp32"}
    before = {k: v.clone() for k, v in packed_state(packed).items()}
    config = QuantizeConfig(format=fmt)
    quantize(fp32, config)
    lean = shared_copy(packed)
    quantize(lean, config)
    kept = {n for n, _ in linear_layers(lean) if config.spec_for(n) is None}
    float_layers_as_loaded(lean, kept)
    assert_same_weights(fp32, lean, kept)
    for k, v in packed_state(packed).items():  # the loaded model is untouched
        assert torch.equal(v, before[k]), k


def test_the_copy_shares_the_blocks_and_owns_its_norms(tmp_path):
    _, packed = loads(tiny_gguf(tmp_path / "m.gguf"))
    copy = shared_copy(packed)
    shared = {id(t) for t in shared_tensors(packed)}
    assert shared and {id(t) for t in shared_tensors(copy)} == shared
    assert copy.model.layers[0].input_layernorm.weight is not packed.model.layers[0].input_layernorm.weight
    set_activations(copy, "f32")
    assert {lin.format.activations for _, lin in packed.linear_layers()} == {"q16"}


def test_blocks_at_float_activations_score_as_the_fp32_load(tmp_path):
    fp32, packed = loads(tiny_gguf(tmp_path / "m.gguf", gguf.GGMLQuantizationType.Q4_0))
    ref = shared_copy(packed)
    set_activations(ref, "f32")
    ids = torch.arange(1, 60) % fp32.config.vocab_size
    torch.testing.assert_close(ref.score(ids), fp32.score(ids), rtol=1e-5, atol=1e-5)


def test_smollm2_layer_by_layer_equals_whole_model_bit_for_bit():
    """The real checkpoint (Q4_1 blocks and their Q8_0 / Q6_K neighbours): int4-g64 either way, byte for byte."""
    fp32, packed = loads("default")
    config = QuantizeConfig(format="int4-g64")
    lean = shared_copy(packed)
    quantize(lean, config)
    quantize(fp32, config)
    float_layers_as_loaded(lean, set())
    assert_same_weights(fp32, lean)


@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "int4-g32-asym", "fp8", "mxfp4"])
def test_quantizing_a_run_of_rows_at_a_time_gives_the_same_bytes(tmp_path, monkeypatch, fmt):
    """Large layers (a 262k-token lm_head) are quantized a few rows at a time: the bytes of the whole-matrix path."""
    import bytediet.models.quantize as q

    _, packed = loads(tiny_gguf(tmp_path / "m.gguf", gguf.GGMLQuantizationType.Q4_0))
    config = QuantizeConfig(format=fmt, output_policy="same")
    whole = shared_copy(packed)
    quantize(whole, config)
    monkeypatch.setattr(q, "ROW_CHUNK_ELEMENTS", 5 * 32)  # 5 rows of 32 inputs: every layer cut, unevenly
    chunked = shared_copy(packed)
    quantize(chunked, config)
    assert_same_weights(whole, chunked)


def test_layers_left_as_loaded_score_as_their_fp32_copy(tmp_path):
    """int8 leaves lm_head as loaded: its blocks at float activations give the fp32 copy's logits exactly."""
    _, packed = loads(tiny_gguf(tmp_path / "m.gguf", gguf.GGMLQuantizationType.Q4_0))
    config = QuantizeConfig(format="int8")
    kept = {n for n, _ in linear_layers(packed) if config.spec_for(n) is None}
    assert kept == {"lm_head"}
    lean, old = shared_copy(packed), shared_copy(packed)
    for model in (lean, old):
        quantize(model, config)
    float_layers_as_loaded(lean, kept)
    fp32 = get_weight_format("fp32")
    old.lm_head.set_packed(fp32, fp32.quantize(old.lm_head.dequantized_weight()))  # what an fp32 load holds
    assert lean.lm_head.format.spec().startswith("gguf-") and lean.lm_head.packed_blocks is packed.lm_head.packed_blocks
    ids = torch.arange(1, 200) % packed.config.vocab_size
    assert torch.equal(lean.score(ids), old.score(ids))


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0])
def test_a_packed_token_table_looks_up_the_float_tables_rows(tmp_path, qtype):
    """packed_embedding: the table stays in its blocks (shared with the tied lm_head and with copies); lookups,
    logits and a saved copy's float table are the float32 load's exactly."""
    from bytediet.kernels import reference
    from bytediet.models.layers import PackedEmbedding
    from bytediet.models.share import float_embedding

    path = tiny_gguf(tmp_path / "m.gguf", qtype)
    plain, _ = load_model(path, keep_packed=True, load_tokenizer=False)
    lean, _ = load_model(path, keep_packed=True, load_tokenizer=False, packed_embedding=True)
    table = lean.model.embed_tokens
    assert isinstance(table, PackedEmbedding) and table.packed_blocks.dtype == torch.uint8
    assert lean.lm_head.packed_blocks is table.packed_blocks  # tied: one set of blocks
    assert lean.dtype == torch.float32 and lean.weight_bytes() == plain.weight_bytes()
    ids = torch.tensor([[5, 0, 95], [7, 7, 1]])
    assert torch.equal(table(ids), plain.model.embed_tokens(ids))
    rows = reference.dequantize_blocks(table.ggml_type, table.packed_blocks[ids.reshape(-1)])
    assert torch.equal(table(ids).reshape(-1, table.embedding_dim), rows)  # the plain-PyTorch twin
    seq = torch.arange(1, 90) % lean.config.vocab_size
    assert torch.equal(lean.score(seq), plain.score(seq))
    copy = shared_copy(lean)
    assert copy.model.embed_tokens.packed_blocks is table.packed_blocks
    float_embedding(copy)
    assert torch.equal(copy.model.embed_tokens.weight, plain.model.embed_tokens.weight)
    assert isinstance(lean.model.embed_tokens, PackedEmbedding)  # the loaded model keeps its blocks


@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "nvfp4", "sparse24"])
def test_a_candidate_kept_only_as_the_kernels_multiply_it_scores_the_same(tmp_path, fmt):
    """native_only: the packed planes dropped beside their repacked copy — the same logits, the same weight bytes,
    the same dequantized weights, and the bytes of the planes freed."""
    from bytediet.kernels import ops
    from bytediet.models.share import native_only

    if ops.native_library() is None:
        pytest.skip("no native kernels on this machine")
    _, packed = loads(tiny_gguf(tmp_path / "m.gguf", gguf.GGMLQuantizationType.Q4_0))
    config = QuantizeConfig(format=fmt)
    full, lean = shared_copy(packed), shared_copy(packed)
    for model in (full, lean):
        quantize(model, config)
    weights = {n: lin.dequantized_weight() for n, lin in linear_layers(full)}
    planes = sum(
        t.numel() * t.element_size()
        for _, lin in linear_layers(lean)
        if lin.native_weight() is not None and not lin.format.spec().startswith("gguf-")
        for t in lin.packed.values()
    )
    assert native_only(lean) == planes > 0
    assert all(lin.packed == {} for _, lin in linear_layers(lean) if not lin.format.spec().startswith("gguf-"))
    assert lean.weight_bytes() == full.weight_bytes()
    for name, lin in linear_layers(lean):  # nvfp4's layout folds its tensor scale per row: the last bit may differ
        torch.testing.assert_close(lin.dequantized_weight(), weights[name], rtol=1e-6, atol=0, msg=name)
    ids = torch.arange(1, 120) % packed.config.vocab_size
    assert torch.equal(lean.score(ids), full.score(ids))
    assert torch.equal(lean.score(ids[:1]), full.score(ids[:1]))  # one row: the block kernels
    for model in (lean, full):  # new planes: counted as planes again
        model.model.layers[0].mlp.down_proj.set_packed(*_int8_of(weights["model.layers.0.mlp.down_proj"]))
    down = lean.model.layers[0].mlp.down_proj
    assert down.dropped_plane_bytes == 0 and down.packed and lean.weight_bytes() == full.weight_bytes()


def _int8_of(weight):
    fmt = get_weight_format("int8")
    return fmt, fmt.quantize(weight)
