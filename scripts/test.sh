#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh Debian machine, then run every test.
# Real services only: PostgreSQL (127.0.0.1:5432, started when down), Prometheus and Alertmanager
# (Debian packages; the tests start their own on free ports), mtail (reads SGLang's canary log), a vLLM CPU
# server, a llama.cpp server, and SGLang's engine itself on the CPU; Node 20 and npm for the tap protocol's
# second implementation (taps/node, TypeScript).
set -euo pipefail
cd "$(dirname "$0")/.."
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

need=()
command -v pg_ctlcluster >/dev/null || need+=(postgresql)
command -v promtool >/dev/null || need+=(prometheus)
command -v amtool >/dev/null || need+=(prometheus-alertmanager)
command -v nats-server >/dev/null || need+=(nats-server)
command -v mtail >/dev/null || need+=(mtail)
command -v node >/dev/null || need+=(nodejs)
command -v npm >/dev/null || need+=(npm)
command -v chromium >/dev/null || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)
if [ ${#need[@]} -gt 0 ]; then
  # Two clones set up at once would meet at apt's own lock, which apt-get does not wait for: the
  # second waits here for the first, and apt waits (5 min at most) for anyone else's dpkg.
  (
    flock 9
    as_root apt-get -o DPkg::Lock::Timeout=300 update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q \
      --no-install-recommends "${need[@]}"
  ) 9>"${TMPDIR:-/tmp}/kvcanary-apt.lock"
fi
if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  as_root pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort | tail -n1)" main start || true
fi

# NATS with JetStream on 127.0.0.1:4222 (the traffic stream's tests): these machines start one; where
# none listens, one of the suite's own, its data in a temporary folder, stopped when the suite ends.
if ! (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; then
  nats_dir="$(mktemp -d)"
  nats-server -js -a 127.0.0.1 -p 4222 -sd "$nats_dir" -l "$nats_dir/nats.log" &
  nats_pid=$!
fi

bash scripts/setup.sh
# The Node tap: npm ci once per lock (node_modules is the clone's), then tsc; its tests, every golden
# vector among them, run in the suite (tests/tap/test_node_tap.py).
bash scripts/setup-node-tap.sh
export KVCANARY_REQUIRE_NODE=1
# deploy/kubernetes is rendered by kubectl's own kustomize (v5+): the machine's kubectl, else one kept
# in the cache (scripts/setup-kubectl.sh says why not Debian's); tests/deploy requires it.
KVCANARY_KUBECTL="${KVCANARY_KUBECTL:-$(bash scripts/setup-kubectl.sh 2> >(grep -v "is ignored: it is neither" >&2))}"
export KVCANARY_KUBECTL KVCANARY_REQUIRE_KUBECTL=1
# The engines' venvs live outside the clone (~/.cache/kvcanary), so fresh clones on one machine share
# them; they are built side by side: llama.cpp's compile is CPU-bound, the vLLM and LiteLLM installs
# are mostly disk and network. docs/setup.md says what each costs the first time and after.
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/kvcanary"
export KVCANARY_VLLM_VENV="${KVCANARY_VLLM_VENV:-$CACHE/venv-vllm}"
export KVCANARY_LLAMACPP_WHEELS="${KVCANARY_LLAMACPP_WHEELS:-$CACHE/wheels}"
export KVCANARY_LLAMACPP_VENV="${KVCANARY_LLAMACPP_VENV:-$CACHE/venv-llamacpp}"
export KVCANARY_LITELLM_VENV="${KVCANARY_LITELLM_VENV:-$CACHE/venv-litellm}"
export KVCANARY_SGLANG_ROUTER_VENV="${KVCANARY_SGLANG_ROUTER_VENV:-$CACHE/venv-sglang-router}"
export KVCANARY_SGLANG_VENV="${KVCANARY_SGLANG_VENV:-$CACHE/venv-sglang}"
mkdir -p "$CACHE"
logs="$(mktemp -d)"
trap 'rm -rf "$logs"; [ -z "${nats_pid:-}" ] || { kill "$nats_pid"; rm -rf "$nats_dir"; }' EXIT
declare -A setups=()
for name in vllm llamacpp litellm sglang-router sglang; do
  bash "scripts/setup-$name.sh" >"$logs/$name.log" 2>&1 &
  setups[$name]=$!
done
failed=0
for name in vllm llamacpp litellm sglang-router sglang; do
  if wait "${setups[$name]}"; then
    grep "^setup-$name:" "$logs/$name.log" | tail -n 1
  else
    cat "$logs/$name.log" >&2
    echo "test.sh: setup-$name.sh failed (its output above)" >&2
    failed=1
  fi
done
[ "$failed" = 0 ] || exit 1
export KVCANARY_REQUIRE_VLLM=1 KVCANARY_REQUIRE_LLAMACPP=1 KVCANARY_REQUIRE_LITELLM=1 KVCANARY_REQUIRE_SGLANG_ROUTER=1
# The incident's own engine: SGLang 0.5.23 on this CPU serving a tiny model (tests/sglang).
export KVCANARY_REQUIRE_SGLANG=1
export KVCANARY_REQUIRE_PROMETHEUS=1
export KVCANARY_REQUIRE_CHROMIUM=1  # the incident page in headless Chromium (tests/monitor/api/test_page_in_browser.py)

# Tests run on parallel workers (pytest-xdist): most of the suite's time is spent waiting on real
# servers and processes, which overlaps on 2 cores. Tests that share a costly fixture stay on one
# worker (tests/conftest.py). KVCANARY_TEST_WORKERS=0 runs them in one process.
set +e
.venv/bin/python -m pytest -q -n "${KVCANARY_TEST_WORKERS:-4}" --dist loadgroup "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a failure of the suite, not a pass.
[ "$rc" = 5 ] && { echo "test.sh: no tests ran" >&2; exit 1; }
exit "$rc"
