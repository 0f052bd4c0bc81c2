#!/usr/bin/env bash
# Install llama-cpp-python (with its OpenAI-compatible server) into its own venv, for the tests in
# tests/llamacpp. Both live outside the clone, so fresh clones on one machine (CI) share them:
#   wheel: $KVCANARY_LLAMACPP_WHEELS, default ${XDG_CACHE_HOME:-~/.cache}/kvcanary/wheels
#   venv:  $KVCANARY_LLAMACPP_VENV,   default ${XDG_CACHE_HOME:-~/.cache}/kvcanary/venv-llamacpp
#
#   bash scripts/setup-llamacpp.sh          # idempotent: a second run only checks the stamp
#   FORCE=1 bash scripts/setup-llamacpp.sh  # recreate the venv (the cached wheel is kept)
#   REBUILD=1 bash scripts/setup-llamacpp.sh  # also rebuild the wheel
#
# Why a wheel of our own: PyPI ships llama-cpp-python as an sdist only, and compiling llama.cpp takes
# about 4 minutes on two cores. It is built once with `pip wheel` and kept; every later venv installs
# that wheel in seconds. GGML_NATIVE=OFF keeps the wheel free of this CPU's extensions beyond the
# baseline ggml picks (AVX2 here), so machines of one CI pool can share it.
# Why a venv of its own: the server extra pins fastapi, starlette and pydantic-settings in ranges that
# need not match the project's. gguf and numpy are there to write the tiny model the tests serve.
# docs/setup.md says why each step is the way it is, and what it costs.
set -euo pipefail

LLAMACPP_VERSION="0.3.36"
GGUF_VERSION="0.19.0"

CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/kvcanary"
WHEELS="${KVCANARY_LLAMACPP_WHEELS:-$CACHE/wheels}"
VENV="${KVCANARY_LLAMACPP_VENV:-$CACHE/venv-llamacpp}"
STAMP="$VENV/.kvcanary-setup"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
ARCH="$(uname -m)"
WANT="llama-cpp-python[server]==$LLAMACPP_VERSION gguf==$GGUF_VERSION numpy python=$PYVER arch=$ARCH"

start=$(date +%s)
log() { echo "setup-llamacpp: [$(( $(date +%s) - start ))s] $*"; }

set_up() {
    [[ "${FORCE:-0}" != "1" && "${REBUILD:-0}" != "1" && -x "$VENV/bin/python" && -f "$STAMP" \
       && "$(cat "$STAMP")" == "$WANT" ]]
}
if set_up; then
    log "already set up in $VENV ($WANT)"
    exit 0
fi

# Two clones set up at once (parallel CI jobs) must not build the wheel twice or half-install the venv;
# the second finds the first one's stamp once it holds the lock (and must not reinstall under its tests).
mkdir -p "$WHEELS" "$(dirname "$VENV")"
exec 9>"$WHEELS/.setup-llamacpp.lock"
flock 9
if set_up; then
    log "set up meanwhile in $VENV ($WANT)"
    exit 0
fi

if [[ "${FORCE:-0}" == "1" || "${REBUILD:-0}" == "1" || ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV with $PYTHON"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
fi
rm -f "$STAMP"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# This machine's pip.conf names local indexes that lack most projects; pip warns once per project.
quiet_pip() { "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

# The wheel loads libllama through ctypes, so pip tags it py3-none-linux_<arch>: one per machine type.
find_wheel() { compgen -G "$WHEELS/llama_cpp_python-$LLAMACPP_VERSION-*-linux_$ARCH.whl" | head -n1 || true; }

if [[ "${REBUILD:-0}" == "1" ]]; then rm -f "$WHEELS"/llama_cpp_python-"$LLAMACPP_VERSION"-*-linux_"$ARCH".whl; fi
WHEEL="$(find_wheel)"
if [[ -z "$WHEEL" ]]; then
    log "building llama-cpp-python==$LLAMACPP_VERSION into $WHEELS (about 4 minutes on 2 cores)"
    # Build into a scratch folder and move the wheel in at the end, so an interrupted build never
    # leaves a wheel behind that a later run would take for a good one.
    build="$(mktemp -d "$WHEELS/.build.XXXXXX")"
    trap 'rm -rf "$build"' EXIT
    if ! CMAKE_ARGS="-DGGML_NATIVE=OFF ${CMAKE_ARGS:-}" \
         CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
         quiet_pip wheel --no-deps "llama-cpp-python==$LLAMACPP_VERSION" -w "$build" >"$build/build.log" 2>&1; then
        tail -n 60 "$build/build.log" >&2
        log "building the wheel failed (log above)"
        exit 1
    fi
    mv "$build"/llama_cpp_python-*.whl "$WHEELS"/
    WHEEL="$(find_wheel)"
    [[ -n "$WHEEL" ]] || { log "pip built no wheel named llama_cpp_python-$LLAMACPP_VERSION-*-linux_$ARCH"; exit 1; }
    log "built $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"
else
    log "reusing $WHEEL"
fi

log "installing $(basename "$WHEEL")[server], gguf==$GGUF_VERSION and numpy"
quiet_pip install --quiet "$WHEEL[server]" "gguf==$GGUF_VERSION" numpy

log "checking imports"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

import gguf  # noqa: F401
import llama_cpp
import llama_cpp.server.app  # noqa: F401  (the [server] extra)

print(f"  llama.cpp system info: {llama_cpp.llama_print_system_info().decode().strip()}")
for name in ("llama_cpp_python", "gguf", "numpy", "fastapi", "uvicorn", "sse-starlette"):
    print(f"  {name}=={md.version(name)}")
EOF

echo "$WANT" > "$STAMP"
log "done: $(du -sh "$VENV" | cut -f1) in $VENV"
