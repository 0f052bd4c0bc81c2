#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh Debian machine, then run every test.
# Real services only: PostgreSQL (127.0.0.1:5432, started when down), Prometheus and Alertmanager
# (Debian packages; the tests start their own on free ports), a vLLM CPU server and a llama.cpp server.
set -euo pipefail
cd "$(dirname "$0")/.."
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

need=()
command -v pg_ctlcluster >/dev/null || need+=(postgresql)
command -v promtool >/dev/null || need+=(prometheus)
command -v amtool >/dev/null || need+=(prometheus-alertmanager)
if [ ${#need[@]} -gt 0 ]; then
  as_root apt-get update -q
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}"
fi
if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  as_root pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort | tail -n1)" main start || true
fi

bash scripts/setup.sh
# vLLM's CPU build (2.5 GB) lives outside the clone, so fresh clones on one machine share it.
export KVCANARY_VLLM_VENV="${KVCANARY_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcanary/venv-vllm}"
mkdir -p "$(dirname "$KVCANARY_VLLM_VENV")"
bash scripts/setup-vllm.sh
export KVCANARY_REQUIRE_VLLM=1
# llama-cpp-python is built once (~4 min on 2 cores) into a wheel cached outside the clone; its venv lives there too.
export KVCANARY_LLAMACPP_WHEELS="${KVCANARY_LLAMACPP_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcanary/wheels}"
export KVCANARY_LLAMACPP_VENV="${KVCANARY_LLAMACPP_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcanary/venv-llamacpp}"
bash scripts/setup-llamacpp.sh
export KVCANARY_REQUIRE_LLAMACPP=1
# A LiteLLM proxy (the gateway the tap runs in) in its own venv, cached outside the clone too.
export KVCANARY_LITELLM_VENV="${KVCANARY_LITELLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcanary/venv-litellm}"
bash scripts/setup-litellm.sh
export KVCANARY_REQUIRE_LITELLM=1
export KVCANARY_REQUIRE_PROMETHEUS=1

set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a failure of the suite, not a pass.
[ "$rc" = 5 ] && { echo "test.sh: no tests ran" >&2; exit 1; }
exit "$rc"
