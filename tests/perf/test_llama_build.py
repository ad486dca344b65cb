"""llama.cpp built at its best: AMX off where advertised (other ISA flags on), and no ratio against a crippled peer."""

from __future__ import annotations

from bytediet.perf.bench import crippled_peer
from bytediet.perf.llama_build import AMX_OPTIONS, cmake_args

XEON = {
    "avx",
    "avx2",
    "fma",
    "f16c",
    "bmi2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
}


def test_a_cpu_that_advertises_amx_builds_without_it_and_keeps_its_other_isa():
    args = cmake_args(XEON)
    assert "-DGGML_NATIVE=OFF" in args
    assert {f"-D{a}=OFF" for a in AMX_OPTIONS} <= set(args)
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX2=ON"} <= set(args)
    assert "-DGGML_AVX512_VBMI=OFF" in args  # not advertised by this CPU


def test_a_cpu_without_amx_builds_native():
    assert cmake_args({"avx", "avx2", "fma", "avx512f"}) == ["-DGGML_NATIVE=ON"]


def test_a_peer_with_its_repacked_kernels_off_gets_no_ratio():
    off = {
        "available": True,
        "info": {"system": "llama.cpp", "extra_buffer_types": False, "extra_buffer_types_note": "died (signal 11)"},
    }
    why = crippled_peer(off)
    assert "repacked kernels off" in why and "CMAKE_ARGS" in why
    assert crippled_peer({"available": True, "info": {"extra_buffer_types": True}}) == ""
    assert crippled_peer({"available": False, "reason": "unavailable"}) == ""


def test_amx_stays_off_even_where_the_tiles_run(monkeypatch):
    """llama-server's AMX kernel died with SIGILL on a VM whose tiles run (session 19): a working probe changes
    nothing."""
    from bytediet.kernels.cpu import amx_probe

    monkeypatch.setattr(amx_probe, "this_machine", lambda: amx_probe.AmxProbe(True, True, "ran"))
    args = cmake_args(XEON)
    assert "-DGGML_NATIVE=OFF" in args and {f"-D{a}=OFF" for a in AMX_OPTIONS} <= set(args)
