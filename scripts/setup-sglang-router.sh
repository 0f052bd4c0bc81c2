#!/usr/bin/env bash
# Install SGLang's model gateway (sglang-router on PyPI) into its own venv, for the prefill/decode
# tests in tests/workers/test_pd_gateway.py: $KVCANARY_SGLANG_ROUTER_VENV, or
# $XDG_CACHE_HOME/kvcanary/venv-sglang-router (~/.cache by default), outside the clone, so fresh
# clones on one machine share one ~150 MB install.
#
#   bash scripts/setup-sglang-router.sh          # idempotent: a second run only checks the stamp
#   FORCE=1 bash scripts/setup-sglang-router.sh  # rebuild from scratch
#
# Why pinned: 0.3.2 is the version whose PD protocol was observed here (registration calls,
# bootstrap_host/port/room in both bodies, which answer the client gets, retries); the reference
# worker's --mode prefill/decode speaks that protocol, and tests/workers/test_pd_gateway.py checks it. Why a venv of its own: the gateway is a Rust binary in
# a wheel with its own fastapi/uvicorn ranges, and it needs nothing of the monitor's (no torch).
set -euo pipefail

ROUTER_VERSION="0.3.2"
PACKAGES=("sglang-router==$ROUTER_VERSION")

VENV="${KVCANARY_SGLANG_ROUTER_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcanary/venv-sglang-router}"
STAMP="$VENV/.kvcanary-setup"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
WANT="${PACKAGES[*]} python=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"

start=$(date +%s)
log() { echo "setup-sglang-router: [$(( $(date +%s) - start ))s] $*"; }

set_up() { [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; }
if [[ "${FORCE:-0}" != "1" ]] && set_up; then
    log "already set up in $VENV (sglang-router==$ROUTER_VERSION)"
    exit 0
fi

# Two clones set up at once (parallel CI jobs) must not install into one venv together; the second
# finds the first one's stamp once it holds the lock.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [[ "${FORCE:-0}" != "1" ]] && set_up; then
    log "set up meanwhile in $VENV (sglang-router==$ROUTER_VERSION)"
    exit 0
fi
log "creating $VENV with $PYTHON"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# This machine's pip.conf names local indexes that lack most projects; pip warns once per project.
quiet_pip() { "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

log "installing sglang-router==$ROUTER_VERSION"
quiet_pip install --quiet "${PACKAGES[@]}"

log "checking the launcher (and that nothing of the monitor's came along)"
"$VENV/bin/python" -m sglang_router.launch_router --help >/dev/null
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import importlib.util

for name in ("torch", "sqlalchemy"):
    assert importlib.util.find_spec(name) is None, f"{name} is in the gateway's venv"
print(f"  sglang-router=={md.version('sglang-router')}")
PY

echo "$WANT" > "$STAMP"
log "done: $(du -sh "$VENV" | cut -f1) in $VENV"
