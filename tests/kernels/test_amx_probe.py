"""The AMX probe: a tile load in a child process tells works from faults; no compiler or no AMX says so."""

from __future__ import annotations

import shutil
import stat

import pytest

from bytediet.kernels.cpu.amx_probe import probe

AMX = {"avx512f", "amx_tile", "amx_int8", "amx_bf16"}


def fake_compiler(tmp_path, program: str):
    """A 'compiler' that writes ``program`` (a shell script) as the binary it was asked for."""
    cc = tmp_path / "fake-cc"
    cc.write_text(
        '#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\n'
        f"printf '%s\\n' '#!/bin/sh' '{program}' > \"$2\"\nchmod +x \"$2\"\n"
    )
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    return str(cc)


def test_a_cpu_without_amx_is_not_probed():
    seen = probe({"avx2", "avx512f"}, compiler="/nonexistent/cc")
    assert not seen.advertised and seen.works is None and seen.describe() == "not advertised"


def test_a_tile_load_that_dies_is_a_fault_with_its_signal(tmp_path):
    seen = probe(AMX, compiler=fake_compiler(tmp_path, "kill -ILL $$"))
    assert seen.advertised and seen.works is False
    assert "signal 4" in seen.reason and seen.describe().startswith("faults")


def test_a_tile_load_that_exits_zero_works(tmp_path):
    assert probe(AMX, compiler=fake_compiler(tmp_path, "exit 0")).works is True


def test_a_kernel_that_refuses_tile_state_is_a_fault(tmp_path):
    seen = probe(AMX, compiler=fake_compiler(tmp_path, "exit 3"))
    assert seen.works is False and "arch_prctl" in seen.reason


def test_no_compiler_means_unknown_not_a_guess(tmp_path):
    seen = probe(AMX, compiler=str(tmp_path / "no-such-cc"))
    assert seen.works is None and "did not compile" in seen.reason


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_the_real_program_compiles_and_gives_an_answer_on_a_cpu_with_amx(tmp_path):
    from bytediet.kernels.cpu.build import cpu_flags

    if not AMX <= cpu_flags():  # every AMX flag (an AVX-512 CPU has avx512f alone)
        pytest.skip("this CPU advertises no AMX")
    seen = probe()
    assert seen.works is not None, seen.reason  # works, or a fault with its signal: never 'could not build'


@pytest.fixture
def amx_cpu(monkeypatch, tmp_path):
    """This process as a CPU that advertises AMX, with its per-boot answer kept under tmp_path."""
    from bytediet.kernels.cpu import amx_probe

    monkeypatch.setattr(amx_probe, "cpu_flags", lambda: frozenset(AMX))
    monkeypatch.setenv("BYTEDIET_KERNEL_CACHE", str(tmp_path / "kernels"))
    amx_probe.this_machine.cache_clear()
    yield amx_probe
    amx_probe.this_machine.cache_clear()


def test_a_faulting_vm_caps_onednn_below_amx_and_a_working_one_does_not(amx_cpu, monkeypatch):
    from bytediet.kernels.cpu.amx_probe import AmxProbe

    monkeypatch.setattr(amx_cpu, "probe", lambda: AmxProbe(True, False, "the first tile load died (signal 4)"))
    env = {}
    assert "capped" in amx_cpu.guard_onednn(env) and env == {"ONEDNN_MAX_CPU_ISA": amx_cpu.ONEDNN_CAP}
    mine = {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert amx_cpu.guard_onednn(mine) == "" and mine == {"ONEDNN_MAX_CPU_ISA": "AVX2"}  # the user's cap wins
    amx_cpu.this_machine.cache_clear()
    # the answer is kept for this boot: a working probe now changes nothing until the next boot
    monkeypatch.setattr(amx_cpu, "probe", lambda: AmxProbe(True, True, "ran"))
    assert amx_cpu.this_machine().works is False


def test_a_working_vm_leaves_onednn_alone_and_a_corrupt_record_is_probed_again(amx_cpu, monkeypatch, tmp_path):
    from bytediet.kernels.cpu.amx_probe import AmxProbe

    (tmp_path / "amx-probe.json").write_text("{not json")
    calls = []
    monkeypatch.setattr(amx_cpu, "probe", lambda: calls.append(1) or AmxProbe(True, True, "ran"))
    env = {}
    assert amx_cpu.guard_onednn(env) == "" and env == {} and calls == [1]
    amx_cpu.this_machine.cache_clear()
    assert amx_cpu.this_machine().works and calls == [1]  # read back, not probed again


def test_on_a_real_amx_cpu_the_cap_keeps_torch_bf16_off_amx(tmp_path):
    """End to end where the CPU has AMX: a kept 'faults' answer makes ``import bytediet`` cap oneDNN, and
    PyTorch's bf16 matmul then runs a kernel without AMX (oneDNN's verbose log names the ISA)."""
    import json
    import os
    import subprocess
    import sys

    from bytediet.kernels.cpu.amx_probe import BOOT_ID
    from bytediet.kernels.cpu.build import cpu_flags

    if not AMX <= cpu_flags():  # every AMX flag (an AVX-512 CPU has avx512f alone)
        pytest.skip("this CPU advertises no AMX")
    kept = {"boot_id": BOOT_ID.read_text().strip(), "works": False, "reason": "pretend: signal 4"}
    (tmp_path / "amx-probe.json").write_text(json.dumps(kept))
    code = (
        "import warnings; warnings.simplefilter('ignore'); import bytediet, torch; print(bytediet.AMX_GUARD); "
        "torch.nn.functional.linear(torch.ones(64, 256).bfloat16(), torch.ones(256, 256).bfloat16())"
    )
    env = {k: v for k, v in os.environ.items() if "CPU_ISA" not in k}
    env.update(BYTEDIET_KERNEL_CACHE=str(tmp_path / "kernels"), ONEDNN_VERBOSE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "capped" in out.stdout
    isa = [line for line in out.stdout.splitlines() if ",isa:" in line]
    assert isa and "AMX" not in isa[0], isa
