"""Entry point: ``python -m kvcanary.workers [flags]`` (see ``python -m kvcanary.workers --help``)."""

from __future__ import annotations

from kvcanary.workers.cli import main

raise SystemExit(main())
