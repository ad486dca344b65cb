"""Whether this CPU's AMX tiles really run: some VMs advertise AMX (and enable its state) yet fault on the first
tile load, so the flags alone cannot tell. A tiny C program asks the kernel for tile state, loads a tile
configuration and one tile, and exits 0; it runs in a child process, so a fault costs nothing here.

The answer is kept per boot (``amx-probe.json`` beside the kernel cache, keyed by the kernel's boot id). Where the
tiles fault, :func:`guard_onednn` caps oneDNN below AMX (``ONEDNN_MAX_CPU_ISA``): PyTorch's bf16 matmul and
attention take AMX kernels where the CPU advertises them, and would die on such a VM.

    python -m bytediet.kernels.cpu.amx_probe   # prints works / faults (why) / unknown (why) / not advertised
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from .cpuinfo import cache_dir, cpu_flags

AMX_FLAGS = frozenset({"amx_tile", "amx_int8", "amx_bf16"})
#: oneDNN's best ISA below AMX, for a CPU whose tiles fault (AVX-512 with VNNI and bf16)
ONEDNN_CAP = "AVX512_CORE_BF16"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <immintrin.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
struct tile_config { uint8_t palette_id, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
int main(void) {
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 3;
  struct tile_config config; memset(&config, 0, sizeof config);
  config.palette_id = 1; config.colsb[0] = 64; config.rows[0] = 16;
  static uint8_t data[16 * 64];
  __asm__ volatile("" : : "r"(&config) : "memory"); /* the compiler would drop stores it thinks nothing reads */
  _tile_loadconfig(&config);
  _tile_loadd(0, data, 64);
  _tile_release();
  return 0;
}
"""


@dataclass(frozen=True)
class AmxProbe:
    """What the probe saw: ``works`` is True/False, or None when it could not tell (``reason`` says why)."""

    advertised: bool
    works: Optional[bool]
    reason: str

    def describe(self) -> str:
        if not self.advertised:
            return "not advertised"
        if self.works:
            return "works"
        return f"faults ({self.reason})" if self.works is False else f"unknown ({self.reason})"


def probe(flags: Iterable[str] | None = None, compiler: str | None = None, timeout_s: float = 60.0) -> AmxProbe:
    """Compile and run the tile-load program in a child (only where the CPU advertises AMX)."""
    flags = set(cpu_flags() if flags is None else flags)
    if not AMX_FLAGS & flags:
        return AmxProbe(False, None, "this CPU advertises no AMX")
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return AmxProbe(True, None, "no C compiler to build the probe (set CC)")
    with tempfile.TemporaryDirectory(prefix="bytediet-amx-") as tmp:
        source, binary = Path(tmp, "amx.c"), Path(tmp, "amx")
        source.write_text(SOURCE)
        try:
            built = subprocess.run(
                [cc, "-O1", "-mamx-tile", "-o", str(binary), str(source)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return AmxProbe(True, None, f"the probe did not compile: {e}")
        if built.returncode != 0:
            return AmxProbe(True, None, f"the probe did not compile: {built.stderr.strip()[:200]}")
        try:
            ran = subprocess.run([str(binary)], capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return AmxProbe(True, False, f"the tile load hung for {timeout_s:.0f} s")
    if ran.returncode == 0:
        return AmxProbe(True, True, "a tile configuration and a tile load ran")
    if ran.returncode == 3:
        return AmxProbe(True, False, "the kernel refused AMX tile state (arch_prctl)")
    how = f"signal {-ran.returncode}" if ran.returncode < 0 else f"exit code {ran.returncode}"
    return AmxProbe(True, False, f"the first tile load died ({how})")


@functools.lru_cache(maxsize=1)
def this_machine() -> AmxProbe:
    """:func:`probe` on this machine: once per boot (kept on disk), once per process."""
    if not AMX_FLAGS & cpu_flags():
        return AmxProbe(False, None, "this CPU advertises no AMX")
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        boot = ""
    path = cache_dir().parent / "amx-probe.json"
    try:
        kept = json.loads(path.read_text())
        if boot and kept.get("boot_id") == boot:
            return AmxProbe(True, kept["works"], kept["reason"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none kept yet, or a corrupt file: probe again
    seen = probe()
    if boot and seen.works is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"boot_id": boot, "works": seen.works, "reason": seen.reason}))
            tmp.replace(path)
        except OSError:
            pass  # a read-only cache: probe again next time
    return seen


def guard_onednn(environ=os.environ) -> str:
    """Cap oneDNN below AMX where this CPU advertises AMX and its tiles fault (a user's own cap wins); returns
    what was done, '' when nothing was. Call before the first bf16 matmul: oneDNN reads the cap once."""
    if "ONEDNN_MAX_CPU_ISA" in environ or "DNNL_MAX_CPU_ISA" in environ:
        return ""
    seen = this_machine()
    if not seen.advertised or seen.works:
        return ""
    environ["ONEDNN_MAX_CPU_ISA"] = ONEDNN_CAP
    return f"AMX {seen.describe()}: oneDNN capped at {ONEDNN_CAP}"


if __name__ == "__main__":
    print(this_machine().describe())
