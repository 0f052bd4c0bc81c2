"""Generate kvcanary's dashboard JSON from code, or check that the committed JSON is current.

    python -m dashboards.build            # (re)write dashboards/*.json
    python dashboards/build.py --check    # exit 1, naming the files, when any is stale

The JSON is what Grafana loads (file provisioning or ``kvcanary dashboards push``); this module is
the only thing that writes it. Keys are sorted and indented by two spaces, with a trailing
newline, so that a diff shows exactly what a change in code changed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grafana_foundation_sdk.builders.dashboard import Dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from kvcanary.dashboards import overview, workers

DASHBOARDS_DIR = Path(__file__).resolve().parent
#: File name -> the function that builds it. One line per dashboard.
DASHBOARDS: dict[str, Callable[[], Dashboard]] = {
    "kvcanary-overview.json": overview.build,
    "kvcanary-workers.json": workers.build,
}


def render(build: Callable[[], Dashboard]) -> str:
    """Return the dashboard's JSON text: sorted keys, two-space indent, trailing newline."""
    return json.dumps(build().build(), cls=JSONEncoder, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def rendered() -> dict[str, str]:
    """Return {file name: JSON text} for every dashboard, built in memory."""
    return {name: render(build) for name, build in DASHBOARDS.items()}


def write(directory: Path = DASHBOARDS_DIR) -> list[Path]:
    """Write every dashboard into ``directory``; return the paths whose content changed."""
    changed = []
    for name, text in rendered().items():
        path = directory / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def stale(directory: Path = DASHBOARDS_DIR) -> list[Path]:
    """Return the committed files that differ from (or are missing against) what the code builds."""
    return [
        directory / name
        for name, text in rendered().items()
        if not (directory / name).exists() or (directory / name).read_text(encoding="utf-8") != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.build", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if any JSON is stale")
    parser.add_argument("--dir", type=Path, default=DASHBOARDS_DIR, help="where the JSON files live")
    args = parser.parse_args(argv)
    if args.check:
        outdated = stale(args.dir)
        for path in outdated:
            print(f"stale: {path} (run: python -m dashboards.build)", file=sys.stderr)
        return 1 if outdated else 0
    for path in write(args.dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
