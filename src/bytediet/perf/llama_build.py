"""How llama.cpp is built at its best on this CPU, for the peers of ``bytediet bench``.

Where the CPU advertises AMX, llama.cpp is built with ``GGML_NATIVE=OFF``, every other ISA extension the CPU has
turned on and AMX off, so its repacked kernels (the extra buffer types) stay on. AMX stays off even where this
machine's tiles run (``kernels.cpu.amx_probe``): some VMs fault on the first tile load, and on one whose tiles do
run (an Intel Xeon, family 6 model 207, session 19) llama.cpp's own AMX kernel died with SIGILL, in llama-server
at its first product (``tilezero`` in an OpenMP worker) and in-process in the bench's probe (bench/RESULTS.md,
Recording 18). Elsewhere ``GGML_NATIVE=ON`` is what its own wheel build does.

    python -m bytediet.perf.llama_build      # prints the CMake arguments (CMAKE_ARGS for llama-cpp-python)
"""

from __future__ import annotations

from typing import Iterable

from ..kernels.cpu.amx_probe import AMX_FLAGS
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


def cmake_args(flags: Iterable[str] | None = None) -> list[str]:
    """llama.cpp's CMake arguments for a CPU with these flags (default: this one)."""
    flags = set(cpu_flags() if flags is None else flags)
    if not AMX_FLAGS & flags:
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
