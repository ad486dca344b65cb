"""lean_heap: tensors of a MiB or more made inside it are given back when freed, where glibc's raised threshold
keeps them."""

import subprocess
import sys

import pytest

PROGRAM = """
import sys, torch
import contextlib
from bytediet.perf.memory import lean_heap, rss_bytes
big = torch.ones(16 << 18)  # 16 MiB freed: glibc raises its mmap threshold above the 4 MiB tensors below
del big
before = rss_bytes()
large, small = [], []
with lean_heap() if sys.argv[1] == "lean" else contextlib.nullcontext():
    for i in range(32):  # 4 MiB tensors, each followed by a small one that stays (the heap cannot shrink past it)
        large.append(torch.ones(1 << 20))
        small.append(torch.ones(64))
del large
print((rss_bytes() - before) / 2**20)
"""


def retained_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def test_freed_large_tensors_leave_the_process_under_a_lean_heap():
    plain = retained_mib("plain")
    if plain < 16:
        pytest.skip(f"this C library gives freed heap memory back by itself ({plain:.1f} MiB kept)")
    assert retained_mib("lean") < 4 < 16 <= plain
