"""What the gateway's filters read of a LiteLLM deployment (a router's ``{"litellm_params": {...}}``
dict): its ``api_base``, the routing key of it that the monitor's sets are keyed by, and its API key.
Both the quarantine filter and the admission guard look deployments up per request, so the key of
each ``api_base`` spelling is computed once and remembered. Standard library only."""

from __future__ import annotations

from typing import Any

from kvcanary.wire import api_base_key

#: api_base spellings whose keys are remembered (a gateway has a few; the bound only caps a
#: gateway whose deployments are made per request).
MAX_REMEMBERED_KEYS = 4096


def params_of(deployment: Any) -> dict[str, Any]:
    params = deployment.get("litellm_params") if isinstance(deployment, dict) else None
    return params if isinstance(params, dict) else {}


def api_base_of(deployment: Any) -> str:
    """Return the deployment's ``api_base``, "" where it names none (a hosted API's default)."""
    api_base = params_of(deployment).get("api_base")
    return api_base if isinstance(api_base, str) else ""


def api_key_of(deployment: Any) -> str | None:
    """Return the deployment's literal API key; None for none or one LiteLLM reads from the
    environment (``os.environ/NAME``), which is not the tap's to read."""
    key = params_of(deployment).get("api_key")
    return key if isinstance(key, str) and key and not key.startswith("os.environ/") else None


class DeploymentKeys:
    """``keys(deployment)``: the routing key of its ``api_base`` (``kvcanary.wire.api_base_key``),
    "" where it names none (never matched by api_base)."""

    def __init__(self) -> None:
        self._keys: dict[str, str] = {}

    def __call__(self, deployment: Any) -> str:
        api_base = api_base_of(deployment)
        if not api_base:
            return ""
        key = self._keys.get(api_base)
        if key is None:
            if len(self._keys) >= MAX_REMEMBERED_KEYS:
                self._keys.clear()
            key = self._keys[api_base] = api_base_key(api_base)
        return key
