"""Every codec answers for itself what the one-call native decode step reads of its pages (LayerKVCache.step_pages):
the pages as LayerSpec fields, or one line saying why not — the native decoder builds its objection from it."""

import pytest
import torch

from bytediet.kernels.types import KVPage, PageKind
from bytediet.kvcache import get_kv_codec
from bytediet.kvcache.base import StepPages

STEPPED = [
    "fp32",
    "bf16",
    "fp16",
    "int8",
    "fp8",
    "q8_0",
    "q5_0",
    "q4_1",
    "q4_0",
    "k=q8_0,v=q4_0",
    "turboquant3",
    "turboquant3.5",
    "k=q5_0,v=turboquant4",
    "rot-int8",
    "k=rot-q8_0,v=q4_0",
]
OBJECTED = {
    "kivi2": "kivi2-keys pages are codes",
    "turboquant_prod3": "turboquant_prod keys",
    "qjl": "pages are codes",
    "polarquant": "polarquant pages are codes",
}


def cache(spec, d=64, block=16):
    return get_kv_codec(spec).create_cache(0, 8, block, 2, d, torch.float32, "cpu")


@pytest.mark.parametrize("spec", STEPPED)
def test_pages_the_step_reads_and_writes_are_described(spec):
    pages = cache(spec).step_pages()
    assert isinstance(pages, StepPages) and pages.objection == ""
    for side in ("k_dtype", "v_dtype"):
        name = pages.fields.get(side) or pages.fields["k_dtype"]
        assert KVPage.named(name).kind in (PageKind.ROW, PageKind.BLOCK, PageKind.TURBOQUANT)
    assert "k_side" not in pages.fields and "v_side" not in pages.fields
    if spec.startswith(("rot-", "k=rot-")):
        assert pages.fields["k_rot"] is not None


@pytest.mark.parametrize("spec,why", sorted(OBJECTED.items()))
def test_pages_it_does_not_write_say_why_in_one_line(spec, why):
    pages = cache(spec, d=128, block=32).step_pages()
    assert pages.fields is None and why in pages.objection and "\n" not in pages.objection


def test_two_part_turboquant_waits_for_its_outlier_channels():
    c = cache("turboquant3.5", d=128)  # two parts at head_dim 128
    assert not c.step_ready()  # the first write chooses them
    c.write(torch.randn(4, 2, 128), torch.randn(4, 2, 128), torch.arange(4), torch.arange(4))
    assert c.step_ready() and cache("int8").step_ready()
