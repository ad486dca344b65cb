"""shared_copy: a configuration quantized layer by layer from the loaded blocks equals quantizing the fp32 load."""

from __future__ import annotations

import gguf
import pytest
import torch

from bytediet.models.loader import load_model, set_activations
from bytediet.models.quantize import QuantizeConfig, linear_layers, quantize
from bytediet.models.share import float_layers_as_loaded, shared_copy, shared_tensors
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


def assert_same_weights(a, b) -> None:
    sa, sb = packed_state(a), packed_state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


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
    float_layers_as_loaded(lean, {n for n, _ in linear_layers(lean) if config.spec_for(n) is None})
    assert_same_weights(fp32, lean)
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
