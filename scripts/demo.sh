#!/usr/bin/env bash
# Set up the project and run the demo: the disclosed KV-cache leak, reproduced, caught and paged,
# and its blast radius in the customer traffic a LiteLLM gateway with the kvcanary tap carried.
# On Debian it installs Prometheus and Alertmanager when missing (the demo starts its own on free
# loopback ports); elsewhere, or without root, the demo runs without them and says what it skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo -n "$@"; else return 1; fi; }

need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null || need+=(prometheus-alertmanager)
if [ ${#need[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  # The lock and the timeout: a test run setting up beside it would hold apt's lock (scripts/test.sh).
  ( flock 9 && as_root apt-get -o DPkg::Lock::Timeout=300 update -q && as_root env DEBIAN_FRONTEND=noninteractive \
      apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends "${need[@]}"
  ) 9>"${TMPDIR:-/tmp}/kvcanary-apt.lock" >/dev/null 2>&1 \
    || echo "demo.sh: could not install ${need[*]}; the demo runs without them" >&2
fi
bash scripts/setup.sh
# A LiteLLM proxy for the demo's gateway (its own venv, cached outside the clone: ~2 min the first
# time, then nothing). Without it the demo runs on without customer traffic and says so.
export KVCANARY_LITELLM_VENV="${KVCANARY_LITELLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcanary/venv-litellm}"
mkdir -p "$(dirname "$KVCANARY_LITELLM_VENV")"
bash scripts/setup-litellm.sh || echo "demo.sh: could not set up LiteLLM; the demo runs without its gateway" >&2
# The incident's own topology (--topology pd) runs behind SGLang's model gateway: its venv, cached
# like LiteLLM's (~100 MB the first time).
if [[ " $* " == *" --topology pd "* || " $* " == *" --topology=pd "* ]]; then
  export KVCANARY_SGLANG_ROUTER_VENV="${KVCANARY_SGLANG_ROUTER_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcanary/venv-sglang-router}"
  bash scripts/setup-sglang-router.sh || echo "demo.sh: could not set up sglang-router" >&2
fi
exec .venv/bin/kvcanary demo "$@"
