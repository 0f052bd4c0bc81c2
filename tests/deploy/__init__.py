"""Tests of ``deploy/``: the Kubernetes overlays rendered by kubectl's own kustomize, and the image.

``kubectl`` comes from PATH, or ``KVCANARY_KUBECTL`` (scripts/setup-kubectl.sh puts one in the
cache where the machine has none recent enough). Its kustomize must be v5 or later: kubectl 1.27+.
Without it these tests skip, or fail when ``KVCANARY_REQUIRE_KUBECTL=1`` (as scripts/test.sh sets it).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent.parent
KUBERNETES = REPO / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBERNETES / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
#: The oldest kustomize that renders these kustomizations (`labels`, `replicas`, inline `patches`).
KUSTOMIZE_MAJOR = 5


def kubectl() -> str:
    """Return a kubectl whose kustomize is v5 or later; skip, or fail under KVCANARY_REQUIRE_KUBECTL=1."""
    path = os.environ.get("KVCANARY_KUBECTL") or shutil.which("kubectl")
    why = "no kubectl on PATH or in KVCANARY_KUBECTL (scripts/setup-kubectl.sh)"
    if path:
        version = _kustomize_version(path)
        if version is not None and version >= KUSTOMIZE_MAJOR:
            return path
        why = f"{path}'s kustomize is v{version}, older than v{KUSTOMIZE_MAJOR} (scripts/setup-kubectl.sh)"
    if os.environ.get("KVCANARY_REQUIRE_KUBECTL") == "1":
        pytest.fail(f"{why}, and KVCANARY_REQUIRE_KUBECTL=1 requires it", pytrace=False)
    pytest.skip(why)


@functools.cache
def _kustomize_version(path: str) -> int | None:
    run = subprocess.run(
        [path, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60
    )
    match = re.match(r"v(\d+)", json.loads(run.stdout or "{}").get("kustomizeVersion", ""))
    return int(match.group(1)) if match else None


@functools.cache
def _rendered(overlay: str, binary: str) -> tuple[str, str]:
    run = subprocess.run(
        [binary, "kustomize", str(KUBERNETES / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, f"kubectl kustomize {overlay}: {run.stderr}"
    return run.stdout, run.stderr


def render(overlay: str) -> list[dict[str, Any]]:
    """Return the objects ``kubectl kustomize`` renders for ``overlay`` (rendered once a session)."""
    text, _ = _rendered(overlay, kubectl())
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render_warnings(overlay: str) -> str:
    """Return what kustomize printed on stderr rendering ``overlay`` (deprecations, warnings)."""
    return _rendered(overlay, kubectl())[1]


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]
