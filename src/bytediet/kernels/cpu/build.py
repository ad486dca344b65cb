"""Compile the native kernel library on this machine, once per ISA variant, and cache the result.

``python -m bytediet.kernels.cpu.build`` (run by ``make setup``) builds every variant this CPU can run;
``dispatch`` builds on first use when the cache is empty. The cache key is the hash of the sources, the
variant's compiler flags, the compiler's version and this CPU's flags, so an edited source, another
compiler or another CPU (these VMs change from session to session) gets a fresh build. A build is
written under a temporary name, then renamed, with the SHA-256 of the library beside it: a truncated
or corrupt file fails that check and is rebuilt, never loaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ...errors import BytedietError
from .cpuinfo import cache_dir, cpu_flags

CSRC = Path(__file__).with_name("csrc")


class KernelBuildError(BytedietError):
    """The native library could not be compiled (no compiler, or the compiler failed)."""


@dataclass(frozen=True)
class Variant:
    """One build of the library: the compiler flags and the CPU flags (``/proc/cpuinfo`` names) it needs."""

    name: str
    compile_flags: tuple[str, ...]
    cpu_flags: frozenset[str]


VARIANTS = (  # best last: dispatch picks the last one this CPU can run
    Variant("avx2", ("-mavx2", "-mfma", "-mf16c"), frozenset({"avx2", "fma", "f16c"})),
    Variant(
        "avx512vnni",
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
    ),
)
COMMON_FLAGS = (
    "-O3",
    "-std=c++17",
    "-fPIC",
    "-shared",
    "-fno-math-errno",
    "-pthread",
    "-ffp-contract=off",
)  # no silent FMA contraction: the float steps match the reference twins


def variant(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise KeyError(f"unknown kernel variant {name!r}; choose one of: {', '.join(v.name for v in VARIANTS)}")


def cpu_model() -> str:
    """This CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def runnable_variants(flags: Optional[frozenset[str]] = None) -> list[Variant]:
    flags = cpu_flags() if flags is None else flags
    return [v for v in VARIANTS if v.cpu_flags <= flags]


def find_compiler() -> Optional[str]:
    """``$CXX``, else the first of g++, c++, clang++ on PATH; None when there is none."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    return None


def compiler_version(compiler: str) -> str:
    out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.splitlines()[0] if out.stdout else compiler


def source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def library_path(v: Variant, compiler: str) -> Path:
    key = hashlib.sha256(
        json.dumps(
            [
                source_hash(),
                COMMON_FLAGS,
                v.compile_flags,
                compiler_version(compiler),
                sorted(cpu_flags() & _ALL_ISA_FLAGS),
            ]
        ).encode()
    ).hexdigest()[:16]
    return cache_dir() / f"libbytediet-{v.name}-{key}.so"


_ALL_ISA_FLAGS = frozenset().union(*(v.cpu_flags for v in VARIANTS))


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def is_intact(lib: Path) -> bool:
    """The library exists and matches the checksum written when it was built."""
    stamp = lib.with_suffix(".sha256")
    return lib.is_file() and stamp.is_file() and stamp.read_text().strip() == _file_sha256(lib)


def build(v: Variant, compiler: Optional[str] = None, force: bool = False) -> Path:
    """The path of the compiled library for ``v``, compiling it if the cache lacks an intact copy."""
    compiler = compiler or find_compiler()
    if compiler is None:
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++: apt-get install g++)")
    lib = library_path(v, compiler)
    if not force and is_intact(lib):
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    sources = sorted(str(p) for p in CSRC.glob("*.cpp"))
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = [compiler, *COMMON_FLAGS, *v.compile_flags, "-I", str(CSRC), *sources, "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise KernelBuildError(f"compiling the {v.name} kernels failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")
    os.replace(tmp, lib)
    lib.with_suffix(".sha256").write_text(_file_sha256(lib) + "\n")
    return lib


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Build bytediet's native CPU kernels for this machine.")
    parser.add_argument("--force", action="store_true", help="rebuild even if an intact cached build exists")
    args = parser.parse_args(argv)
    runnable = runnable_variants()
    if not runnable:
        print("bytediet kernels: this CPU lacks AVX2/FMA/F16C; the PyTorch reference kernels will run", file=sys.stderr)
        return 0
    try:
        for v in runnable:
            print(f"bytediet kernels: {v.name} → {build(v, force=args.force)}", file=sys.stderr)
    except KernelBuildError as e:  # set-up goes on: the reference kernels run, and dispatch says so
        print(f"bytediet kernels: {e}\nthe PyTorch reference kernels will run instead", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
