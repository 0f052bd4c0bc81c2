#!/usr/bin/env bash
# Set up the project's virtual environment in .venv (idempotent; re-runs when pyproject.toml changes).
# torch is installed first and pinned to 2.13.0: on these machines pip takes its CPU wheel from local
# disk instead of downloading a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.kvcanary-setup
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/kvcanary ]; then
  exit 0
fi
start=$(date +%s)
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# grafana-client pulls urllib3-future, whose wheel overrides urllib3 at every start (setup-notes §1).
export URLLIB3_NO_OVERRIDE=1
# This machine's pip.conf names local indexes that lack most projects; pip warns once per project.
pip() { .venv/bin/pip -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
pip install 'torch==2.13.0' numpy
pip install --no-binary urllib3-future -e '.[worker,dashboards,dev]'
echo "$want" > "$stamp"
echo "setup: .venv ready in $(( $(date +%s) - start ))s"
