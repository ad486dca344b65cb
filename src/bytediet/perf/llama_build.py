"""How llama.cpp is built at its best on this CPU, for the peers of ``bytediet bench``.

Where the CPU advertises AMX, some VMs fault on the first tile load (``kernels.cpu.amx_probe`` runs one in a child):
llama.cpp is then built with ``GGML_NATIVE=OFF``, every other ISA extension the CPU has turned on and AMX off, so
its repacked kernels (the extra buffer types) stay on. Where the tiles work, or the CPU has no AMX,
``GGML_NATIVE=ON`` is what its own wheel build does (AMX included where it runs).

    python -m bytediet.perf.llama_build      # prints the CMake arguments (CMAKE_ARGS for llama-cpp-python)
"""

from __future__ import annotations

from typing import Iterable, Optional

from ..kernels.cpu import amx_probe
from ..kernels.cpu.build import cpu_flags

#: /proc/cpuinfo flag → llama.cpp's CMake option for it
ISA_OPTIONS = {
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "bmi2": "GGML_BMI2",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cmake_args(flags: Iterable[str] | None = None, amx_works: Optional[bool] = None) -> list[str]:
    """llama.cpp's CMake arguments for a CPU with these flags (default: this one). ``amx_works`` says whether its
    tiles run (default: this machine's probe when ``flags`` are its own); AMX stays off unless they are known to."""
    this_cpu = flags is None
    flags = set(cpu_flags() if this_cpu else flags)
    if not amx_probe.AMX_FLAGS & flags:
        return ["-DGGML_NATIVE=ON"]
    if amx_works is None and this_cpu:
        amx_works = amx_probe.this_machine().works
    if amx_works:
        return ["-DGGML_NATIVE=ON"]
    return (
        ["-DGGML_NATIVE=OFF"]
        + [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in ISA_OPTIONS.items()]
        + [f"-D{opt}=OFF" for opt in AMX_OPTIONS]
    )


REBUILD_HINT = (
    "rebuild llama-cpp-python without AMX and with its repacked kernels: "
    'CMAKE_ARGS="$(python -m bytediet.perf.llama_build)" pip install --force-reinstall --no-cache-dir '
    "--no-binary llama-cpp-python llama-cpp-python"
)


if __name__ == "__main__":
    print(" ".join(cmake_args()))
