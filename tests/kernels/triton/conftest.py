"""Triton kernels run in the CPU interpreter here (TRITON_INTERPRET=1, set before triton is imported; a value already
set, e.g. 0 on a GPU machine, is kept); these tests are not collected where triton is missing."""

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
collect_ignore_glob = [] if importlib.util.find_spec("triton") else ["test_*.py"]
