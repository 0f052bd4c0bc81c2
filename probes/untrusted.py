"""Text an engine wrote, made safe to show: bounded, one line, no control or bidi characters.

A node's server info, its error bodies and its metric labels are the engine's to write, and a
hostile or broken engine controls them. Pool names holding ``<script>``, bidi overrides (U+202E),
ESC, BEL or NUL went raw into incident titles, the incident page, Alertmanager annotations (which
Slack and others render as markup) and the terminal. Everything taken from an engine passes here
where it is read:

- :func:`plain` for free text (error messages, a result's detail): control characters become
  spaces, format characters (bidi overrides and isolates, zero-width joiners, BOM) and surrogates
  become U+FFFD so that tampering shows, runs of space collapse, and the length is bounded;
- :func:`word` for what names a thing (pool names, versions, modes, model names, fact values): the
  characters a name or version is made of, anything else replaced by ``?``, so markup and shell or
  Markdown syntax never survive, however a sink renders it.
"""

from __future__ import annotations

import re
import unicodedata

#: Characters a name, version or label value of any engine here is made of.
_WORD_CHARS = re.compile(r"[^A-Za-z0-9 _.,:;/+=@()\[\]#%~-]")
_SPACES = re.compile(r"\s+")
#: Unicode categories shown as U+FFFD: format (bidi, zero-width, BOM), surrogates, private use.
_HIDDEN = frozenset({"Cf", "Cs", "Co"})
#: ... and as a space: control characters and line or paragraph separators.
_BREAKS = frozenset({"Cc", "Zl", "Zp"})
ELLIPSIS = "…"


def plain(text: object, limit: int) -> str:
    """Return ``text`` as one line of at most ``limit`` characters with nothing hidden in it."""
    out = []
    for char in str(text)[: limit * 4]:  # bounded work, whatever was sent
        category = unicodedata.category(char)
        out.append(" " if category in _BREAKS else "\ufffd" if category in _HIDDEN else char)
    return _bounded(_SPACES.sub(" ", "".join(out)).strip(), limit)


def word(text: object, limit: int = 64) -> str:
    """Return ``text`` as a name: the characters of names and versions only (others ``?``), bounded."""
    return _bounded(_WORD_CHARS.sub("?", plain(text, limit)), limit)


def _bounded(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + ELLIPSIS
