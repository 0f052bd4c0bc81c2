#!/usr/bin/env bash
# Set up the project and run the demo: the disclosed KV-cache leak, reproduced and caught.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvcanary demo "$@"
