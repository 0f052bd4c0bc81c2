"""The kvcanary reference serving worker: a small paged-KV torch engine behind an OpenAI-compatible API.

It stands alone: nothing here imports ``monitor`` or ``probes``. Run it with ``python -m kvcanary.workers``.
"""

from __future__ import annotations

__version__ = "0.1.0"
