"""Entry point: ``python -m workers [flags]`` (see ``python -m workers --help``)."""

from __future__ import annotations

from workers.cli import main

raise SystemExit(main())
