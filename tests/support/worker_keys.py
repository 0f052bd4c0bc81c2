"""The reference worker's flags that give each probe-test tenant its API key (``--api-key KEY=TENANT``)."""

from tests.probes.probe_harness import KEYS

KEY_FLAGS = tuple(arg for tenant, key in KEYS.items() for arg in ("--api-key", f"{key}={tenant}"))
