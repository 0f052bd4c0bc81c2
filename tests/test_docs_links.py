"""Every link in the repository's Markdown resolves inside the repository.

Why: a clone has only what is committed. A link to a team note next to the checkout, or a file
renamed without its links, reads fine where it was written and is dead everywhere else. So a
relative link must name a file inside the repository (never one reached by climbing out of it with
``..``), and a ``#anchor`` must name a heading of the file it points at, slugged as GitHub does.
Links with a scheme (``https:``, ``mailto:``) are not fetched: the test needs no network.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".venv", ".git", "node_modules", "__pycache__"}
TEXT_SUFFIXES = (".py", ".md", ".sh", ".yml", ".yaml", ".toml", ".html", ".txt")
# Written in two halves so that this file does not match itself.
OUTSIDE_PATHS = ("../" + "shared/", "shared" + "/docs/")

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+[\"'(][^)]*)?\)")
REF_DEF = re.compile(r"^ {0,3}\[([^\]^][^\]]*)\]:\s*(<[^>]*>|\S+)")
ATX = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def repo_files(*patterns: str) -> list[Path]:
    """Files git knows (tracked, plus new ones not ignored, so a file is checked before its commit)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", *patterns],
            cwd=ROOT,
            capture_output=True,
            check=True,
            text=True,
        ).stdout
        paths = sorted({ROOT / p for p in out.split("\0") if p})
    except (OSError, subprocess.CalledProcessError):  # no git, or not a checkout: walk the tree
        paths = sorted(p for pat in patterns for p in ROOT.rglob(pat))
    return [p for p in paths if p.is_file() and not SKIP_DIRS & set(p.relative_to(ROOT).parts)]


def prose_lines(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks; inline code spans blanked unless told."""
    lines, fence = [], ""
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = ""
            continue
        if m:
            fence = m.group(1)
            continue
        lines.append((number, CODE_SPAN.sub("", line) if blank_code else line))
    return lines


def slug(heading: str) -> str:
    """GitHub's heading anchor: rendered text, lowercase, punctuation dropped, spaces to hyphens.

    GitHub keeps letters, digits, ``_`` and ``-``, so ``duplicate_ids`` keeps its underscore.
    """
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file offers: heading slugs (repeats get -1, -2...) and HTML anchors."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    prev = ""
    for _, line in prose_lines(path.read_text(encoding="utf-8", errors="replace"), blank_code=False):
        found.update(HTML_ANCHOR.findall(line))
        m = ATX.match(line)
        setext = re.fullmatch(r" {0,3}(=+|-+)\s*", line) and prev.strip() and not ATX.match(prev)
        text = m.group(2) if m else prev.strip() if setext and not re.match(r"\s*[|>*+-]", prev) else None
        prev = line
        if text is None:
            continue
        base = slug(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition."""
    out = []
    for number, line in prose_lines(text):
        targets = [m.group(1) for m in INLINE_LINK.finditer(line)]
        if ref := REF_DEF.match(line):
            targets.append(ref.group(2))
        out.extend((number, t.strip("<>")) for t in targets if t.strip("<>"))
    return out


def check_target(source: Path, target: str) -> str | None:
    """Why ``target``, linked from ``source``, does not resolve; None when it does."""
    if SCHEME.match(target):
        return None
    path_part, _, anchor = target.partition("#")
    path_part = unquote(path_part.split("?", 1)[0])
    if not path_part:
        dest = source
    else:
        base = ROOT if path_part.startswith("/") else source.parent
        dest = Path(os.path.normpath(base / path_part.lstrip("/")))
        if dest != ROOT and ROOT not in dest.parents:
            return "points outside the repository (a clone does not have it)"
        if not dest.exists():
            return f"no such file: {dest.relative_to(ROOT)}"
    if anchor and dest.is_file() and dest.suffix.lower() == ".md" and unquote(anchor) not in anchors(dest):
        return f"no heading with anchor #{anchor} in {dest.relative_to(ROOT)}"
    return None


MARKDOWN = repo_files("*.md")


@pytest.mark.parametrize("md", MARKDOWN, ids=[str(p.relative_to(ROOT)) for p in MARKDOWN])
def test_markdown_links_resolve_inside_the_repository(md: Path) -> None:
    """Each relative link and anchor in one Markdown file names something a clone has."""
    rel = md.relative_to(ROOT)
    broken = [
        f"{rel}:{number}: {target}: {why}"
        for number, target in links(md.read_text(encoding="utf-8", errors="replace"))
        if (why := check_target(md, target))
    ]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_no_file_points_at_the_team_notes_outside_the_repository() -> None:
    """No text file may send a reader to the team's notes beside the checkout: clones lack them."""
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}"
        for path in repo_files(*(f"*{s}" for s in TEXT_SUFFIXES))
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if any(needle in line for needle in OUTSIDE_PATHS)
    ]
    assert not hits, "mentions of paths outside the repository:\n" + "\n".join(hits)


def test_the_checker_refuses_what_a_clone_cannot_follow() -> None:
    """The checker itself: a link out of the repository, a missing file or heading each fail."""
    readme = ROOT / "README.md"
    assert "outside the repository" in (check_target(readme, "../" + "shared/" + "docs/real-bugs.md") or "")
    # Written in two halves: test_contract.py checks that every path the code cites exists.
    assert "no such file" in (check_target(readme, "docs/" + "no-such-page.md") or "")
    assert "no heading" in (check_target(readme, "docs/architecture.md#no-such-heading") or "")
    assert check_target(readme, "docs/architecture.md#the-incident-in-one-paragraph") is None
    assert check_target(readme, "https://example.invalid/x") is None
