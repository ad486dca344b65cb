"""The ctypes mirrors (kernels/cpu/structs.py) against the library's own report of its structs' layout, for every
variant this CPU runs; and the checker itself, fed mirrors that are wrong on purpose."""

import ctypes

import pytest

from bytediet.kernels.cpu import build, dispatch, structs

VARIANTS = [v.name for v in build.runnable_variants()] if build.find_compiler() else []


def layout(variant):
    return structs.parse_layout(dispatch.load(variant).bd_struct_layout().decode())


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_mirror_matches_the_library_field_by_field(variant):
    report = layout(variant)
    assert set(report) == set(structs.MIRRORS)
    assert structs.mismatches(report) == []
    for name, mirror in structs.MIRRORS.items():  # the report is not empty: every field of every mirror is in it
        assert set(report[name]) == {"sizeof", *(f[0] for f in mirror._fields_)}


class MovedField(ctypes.Structure):  # bd::LinearDesc with n and k swapped: same size, two offsets wrong
    _fields_ = [
        ("blocks", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("k", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("ggml_type", ctypes.c_int32),
        ("interleaved", ctypes.c_int32),
        ("source", ctypes.c_void_p),
    ]


class MissingField(ctypes.Structure):  # bd::CodePagesDesc without its last field
    _fields_ = [(name, ctypes.c_void_p) for name in ("scale", "zero", "stage_of", "stage")] + [
        ("group", ctypes.c_int64),
        ("window", ctypes.c_int64),
        ("transform", ctypes.c_void_p),
    ]


@pytest.mark.parametrize("variant", VARIANTS[:1])
def test_a_moved_or_missing_field_is_reported(variant, monkeypatch):
    report = layout(variant)
    moved = structs.mismatches(report, {"LinearDesc": MovedField})
    assert moved == ["LinearDesc.k: library 24, mirror 16", "LinearDesc.n: library 16, mirror 24"]
    missing = structs.mismatches(report, {"CodePagesDesc": MissingField})
    assert "CodePagesDesc.sizeof: library 64, mirror 56" in missing
    assert "CodePagesDesc.table: library 56, mirror None" in missing
    monkeypatch.setitem(structs.MIRRORS, "LinearDesc", MovedField)
    with pytest.raises(structs.ABIError, match="LinearDesc.k: library 24, mirror 16"):
        structs.check(dispatch.load(variant))


def test_a_struct_the_library_does_not_report_is_a_mismatch():
    assert structs.mismatches({}, {"LinearDesc": structs.LinearDesc}) == ["LinearDesc: the library does not report it"]
