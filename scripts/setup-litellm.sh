#!/usr/bin/env bash
# Install a LiteLLM proxy into its own venv, for the gateway-tap tests in tests/litellm:
# $KVCANARY_LITELLM_VENV, or .venv-litellm in the repo. scripts/test.sh points it
# at a cache outside the clone, so fresh clones on one machine share one ~800 MB install.
#
#   bash scripts/setup-litellm.sh          # idempotent: a second run only checks the stamp
#   FORCE=1 bash scripts/setup-litellm.sh  # rebuild from scratch
#
# Why pinned: litellm 1.82.7 and 1.82.8 in the package index were compromised (March 2026); 1.110.2 is
# the version measured here. Why not `litellm[proxy]`: the extra pins litellm-proxy-extras and
# litellm-enterprise releases the index does not carry, so the extra's own requirement list is
# installed instead, with the nearest releases it does carry. Why a venv of its own: the proxy pins
# fastapi, starlette and pydantic ranges of its own, and the tap must be shown to run beside them
# with nothing of the monitor's (no torch, no SQLAlchemy). docs/setup.md says more, and what it costs.
set -euo pipefail

LITELLM_VERSION="1.110.2"
PACKAGES=(
    "litellm==$LITELLM_VERSION" "litellm-proxy-extras==0.4.110" "litellm-enterprise==0.1.83"
    "gunicorn<24.0,>=23.0.0" "uvicorn<1.0,>=0.33.0" "granian<3.0,>=2.7.4" "uvloop<1.0,>=0.22.1"
    "fastapi<1.0,>=0.136.3" "starlette<2.0,>=1.0.1" "backoff<3.0,>=2.2.1" "pyyaml<7.0,>=6.0.3"
    "rq<3.0,>=2.7.0" "orjson<4.0,>=3.11.6" "hiredis<4.0,>=3.0.0" "apscheduler<4.0,>=3.11.2"
    "fastapi-sso<1.0,>=0.19.0" "pyjwt<3.0,>=2.13.0" "python-multipart<1.0,>=0.0.27"
    "cryptography<51.0,>=49.0.0" "pynacl<2.0,>=1.6.2" "websockets<16.0,>=15.0.1" "boto3<2.0,>=1.43.117"
    "azure-identity<2.0,>=1.25.2" "azure-storage-blob<13.0,>=12.28.0" "mcp<3,>=2.3.0" "httpx2<3,>=2.10.0"
    "pydantic<3,>=2.12.0" "restrictedpython<9.0,>=8.5" "rich<14.0,>=13.9.4" "inquirerpy<1.0,>=0.3.4"
    "tomlkit<1.0,>=0.13.3" "polars<2.0,>=1.38.1" "soundfile<1.0,>=0.12.1" "pyroscope-io<1.0,>=0.8.16"
    "expression<6.0,>=5.6.0" "backports-zstd<2.0,>=1.0.0" "semver<4,>=3.0.4" openai
    # The tap's JetStream sink (KVCANARY_TAP_URL=nats://...).
    "nats-py>=2.6,<3"
)

REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${KVCANARY_LITELLM_VENV:-$REPO/.venv-litellm}"
STAMP="$VENV/.kvcanary-setup"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
WANT="${PACKAGES[*]} python=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"

start=$(date +%s)
log() { echo "setup-litellm: [$(( $(date +%s) - start ))s] $*"; }

set_up() { [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; }
if [[ "${FORCE:-0}" != "1" ]] && set_up; then
    log "already set up in $VENV (litellm==$LITELLM_VERSION)"
    exit 0
fi

# Two clones set up at once (parallel CI jobs) must not install into one venv together; the second
# finds the first one's stamp once it holds the lock.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [[ "${FORCE:-0}" != "1" ]] && set_up; then
    log "set up meanwhile in $VENV (litellm==$LITELLM_VERSION)"
    exit 0
fi
log "creating $VENV with $PYTHON"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
quiet_pip() { "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

log "installing litellm==$LITELLM_VERSION and the proxy's requirements"
quiet_pip install --quiet "${PACKAGES[@]}"

log "checking imports (and that nothing of the monitor's came along)"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import importlib.util

import litellm.proxy.proxy_server  # noqa: F401
from litellm.integrations.custom_logger import CustomLogger  # noqa: F401

for name in ("torch", "sqlalchemy"):
    assert importlib.util.find_spec(name) is None, f"{name} is in the gateway's venv"
print(f"  litellm=={md.version('litellm')}")
PY

echo "$WANT" > "$STAMP"
log "done: $(du -sh "$VENV" | cut -f1) in $VENV"
