"""The ``kvcanary`` console script: one entry point that both layouts can import.

In a checkout and an editable install this imports ``monitor.commands.cli``; the wheel's build rewrites the
import to ``kvcanary.monitor.commands.cli``, as it does every import of the repository's top-level folders.
"""

from __future__ import annotations

from monitor.commands.cli import main

__all__ = ["main"]
