"""The ids shared with native code: kernels/types.py's enums against the library's own report (csrc/types.h),
for every variant this CPU runs, and against the names the rest of bytediet uses for them."""

import pytest
from gguf import GGMLQuantizationType

from bytediet.kernels import decoder_spec, native_layouts, types
from bytediet.kernels.cpu import build, dispatch

VARIANTS = [v.name for v in build.runnable_variants()] if build.find_compiler() else []


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_python_id_equals_the_library_s(variant):
    reported = dispatch.load(variant).type_ids()
    for enum in types.ENUMS:
        assert {m.name: int(m) for m in enum} == reported[enum.__name__], enum.__name__
    assert set(reported) == {enum.__name__ for enum in types.ENUMS}


def test_ids_are_explicit_and_unique():
    for enum in types.ENUMS:
        values = [int(m) for m in enum]
        assert len(values) == len(set(values)), enum.__name__


def test_ggml_weight_types_are_gguf_s():
    for m in types.WeightType:
        if int(m) < 100:
            assert GGMLQuantizationType[m.name] == int(m)
    assert native_layouts.TYPES == {m for m in types.WeightType if int(m) >= 100}


def test_page_names_round_trip_and_group_by_kind():
    for m in types.KVPage:
        assert types.KVPage.named(m.page_name) is m
    assert decoder_spec.KV_PAGE_TYPES == tuple(m.page_name for m in types.KVPage)
    for name, ggml in decoder_spec.BLOCK_PAGE_TYPES.items():
        assert types.KVPage.named(name).kind == types.PageKind.BLOCK and ggml.name == types.KVPage.named(name).name
    with pytest.raises(ValueError, match="no KV page type"):
        types.KVPage.named("q3_k")
    assert types.Activations.named("q8-token") == types.Activations.Q8_TOKEN
    with pytest.raises(ValueError, match="activations must be one of"):
        types.Activations.named("q4")
