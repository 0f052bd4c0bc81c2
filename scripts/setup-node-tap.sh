#!/usr/bin/env bash
# Build the Node tap (taps/node: TypeScript, the tap protocol's second implementation) for its
# tests (tests/tap/test_node_tap.py): `npm ci` from the committed package-lock.json when the lock or
# Node's version changed since the last install (node_modules is the clone's own: typescript and
# Node's types, 26 MB), then `tsc`, which compiles only what changed.
#
#   bash scripts/setup-node-tap.sh          # idempotent: after the first run, the compile only
#   FORCE=1 bash scripts/setup-node-tap.sh  # install again from scratch
#
# Needs Node 20 or later (String.prototype.toWellFormed, global fetch) and npm; docs/setup.md says
# what it costs.
set -euo pipefail

TAP="$(cd "$(dirname "$0")/.." && pwd)/taps/node"
cd "$TAP"
command -v node >/dev/null && command -v npm >/dev/null || { echo "setup-node-tap: node and npm are needed" >&2; exit 1; }
major=$(node -p 'process.versions.node.split(".")[0]')
[ "$major" -ge 20 ] || { echo "setup-node-tap: Node $(node --version) is too old: 20 or later" >&2; exit 1; }
start=$(date +%s)
stamp=node_modules/.kvcanary-setup
want="$(sha256sum package-lock.json | cut -c1-16) node=$(node --version)"
if [ -n "${FORCE:-}" ] || [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  npm ci --no-audit --no-fund --loglevel=error
  echo "$want" > "$stamp"
fi
node node_modules/typescript/bin/tsc -p . --incremental --tsBuildInfoFile dist/.tsbuildinfo
echo "setup-node-tap: taps/node built in $(( $(date +%s) - start ))s"
