"""The ``kvcanary`` console script's entry point."""

from __future__ import annotations

from kvcanary.monitor.commands.cli import main

__all__ = ["main"]
