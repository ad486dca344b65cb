#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` from the llama.cpp sources that the pinned llama-cpp-python sdist ships,
# so the server peer runs the same llama.cpp as the in-process peer. Idempotent: when the binary exists it only
# prints its path. The build takes ~10-20 min on 2 cores.
#
#   bench/build_llama_server.sh            # prints the path of llama-server on its last line
#   BYTEDIET_LLAMA_SERVER_DIR=/some/dir JOBS=4 bench/build_llama_server.sh
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
constraints="${CONSTRAINTS:-$here/constraints.txt}"
[ -f "$constraints" ] || constraints=/work/main/constraints.txt
version="${LLAMA_CPP_PYTHON_VERSION:-$(sed -n 's/^llama[-_]cpp[-_]python==//p' "$constraints" | head -1)}"
[ -n "$version" ] || { echo "no llama-cpp-python pin in $constraints; set LLAMA_CPP_PYTHON_VERSION" >&2; exit 2; }
root="${BYTEDIET_LLAMA_SERVER_DIR:-$HOME/.cache/bytediet/llama-server}/$version"
binary="$root/build/bin/llama-server"
python="${PYTHON:-python3}"
[ -x "$here/.venv/bin/python" ] && python="$here/.venv/bin/python"
[ -x /work/main/.venv/bin/python ] && [ -z "${PYTHON:-}" ] && python=/work/main/.venv/bin/python

# GGML_NATIVE=ON (-march=native, as llama-cpp-python's own wheel build), or, where the CPU advertises AMX, every
# other ISA flag on and AMX off (bytediet.perf.llama_build says why); LLAMA_CURL off: no downloads. A binary built
# with other arguments is rebuilt.
isa_args="$(PYTHONPATH="$here/src" "$python" -m bytediet.perf.llama_build)"
stamp="$root/build/bytediet-cmake-args"
if [ -x "$binary" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$isa_args" ]; then echo "$binary"; exit 0; fi
rm -rf "$root/build"
mkdir -p "$root"
if [ ! -d "$root/src" ]; then
  # pip prepares the sdist's metadata, so it fetches the build backend (scikit-build-core) from the index
  "$python" -m pip download --no-binary :all: --no-deps -d "$root/sdist" "llama-cpp-python==$version" >&2
  tmp="$root/src.tmp"; rm -rf "$tmp"; mkdir -p "$tmp"
  tar -xzf "$root"/sdist/llama_cpp_python-"$version".tar.gz -C "$tmp" --strip-components=1
  mv "$tmp" "$root/src"
fi
# shellcheck disable=SC2086
nice -n 10 cmake -S "$root/src/vendor/llama.cpp" -B "$root/build" -DCMAKE_BUILD_TYPE=Release $isa_args \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >&2
nice -n 10 cmake --build "$root/build" --target llama-server -j "${JOBS:-2}" >&2
[ -x "$binary" ] || { echo "the build finished without $binary" >&2; exit 1; }
printf '%s' "$isa_args" > "$stamp"
echo "$binary"
