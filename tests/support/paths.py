"""Where the checkout is: tests start processes and read files from it."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
