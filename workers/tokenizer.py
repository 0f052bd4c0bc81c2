"""Byte-level tokens and the chat template.

One UTF-8 byte is one token (vocabulary 256). Text comes back with ``errors="replace"``, so stale or
partial bytes never raise. The chat template is deliberately trivial: the contents of the messages,
in order (system, user, assistant alike), joined by ``"\\n"``; roles are not rendered. The model
echoes that rendered prompt.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable


def encode(text: str) -> list[int]:
    """Return the UTF-8 bytes of ``text`` as token ids."""
    return list(text.encode("utf-8"))


def decode(token_ids: Iterable[int]) -> str:
    """Return the text of ``token_ids``; invalid UTF-8 becomes U+FFFD."""
    return bytes(token_ids).decode("utf-8", errors="replace")


def render_chat(contents: Iterable[str]) -> str:
    """Return the chat prompt: the message contents joined by newlines."""
    return "\n".join(contents)


class StreamDecoder:
    """Turn tokens into text deltas as they stream, holding back incomplete multi-byte characters."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Return the text completed by ``token_id`` (possibly empty)."""
        return self._decoder.decode(bytes((token_id,)))

    def flush(self) -> str:
        """Return whatever is still held back, replaced if incomplete."""
        return self._decoder.decode(b"", final=True)
