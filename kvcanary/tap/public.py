"""Texts the gateway's operator declares public (``KVCANARY_TAP_PUBLIC_TEXTS``): licences, published
documentation, the company's own boilerplate. Nobody's private input, yet a model recites them, and a
recital of a text that one customer alone has pasted so far looks, to prints that hold no text, like
that customer's text in another's answer. Told which texts are public, the tap leaves their prints
out of prompts' lists and sends them as ``OWN`` in answers (``record.summarize``), and leaves their
distinctive tokens out of both sides (``docs/tap-protocol.md``, "Fingerprints", step 8).

A text is read whole, in pieces of ``MAX_TEXT_CHARS`` that overlap by ``PIECE_OVERLAP_CHARS`` (an
8-word n-gram across a border is read in one of them), and the prints of every text go into one set,
frozen once: reading costs a few seconds for 16 MB, and the set about 90 bytes a print (16 MB of
English text: about 700,000 prints, some 60 MB, in each gateway process). Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvcanary.tap.distinctive import TokenPrints, distinctive_words
from kvcanary.tap.fingerprints import MAX_TEXT_CHARS, Fingerprinter

#: The most public text a tap reads: its prints stay in every gateway process's memory.
MAX_PUBLIC_BYTES = 16 * 1024 * 1024
#: Characters two pieces of a text share, so that a run across their border is read whole.
PIECE_OVERLAP_CHARS = 1024


@dataclass(frozen=True)
class PublicPrints:
    """The n-gram prints and the distinctive tokens' prints of the public texts, under one key."""

    prints: frozenset[int]
    tokens: frozenset[int]
    files: int = 0


def files_of(paths: Iterable[Path]) -> list[Path]:
    """Return the files at ``paths`` (a folder: every file under it); raise ValueError naming a path
    that is neither a file nor a folder, or texts over ``MAX_PUBLIC_BYTES`` in all."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(f for f in path.rglob("*") if f.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"{path} is neither a file nor a folder")
    if sum(f.stat().st_size for f in files) > MAX_PUBLIC_BYTES:
        raise ValueError(f"over {MAX_PUBLIC_BYTES} bytes of text")
    return files


def public_prints(texts: Iterable[str], fingerprinter: Fingerprinter) -> PublicPrints:
    """Return the prints of ``texts``, each read whole, under ``fingerprinter``'s key."""
    prints: set[int] = set()
    tokens: set[int] = set()
    keyed, count = TokenPrints(fingerprinter.key), 0
    step = MAX_TEXT_CHARS - PIECE_OVERLAP_CHARS
    for text in texts:
        count += 1
        for at in range(0, max(len(text) - PIECE_OVERLAP_CHARS, 1), step):
            piece = text[at : at + MAX_TEXT_CHARS]
            prints.update(fingerprinter.fingerprints(piece, cap=None)[0])
            tokens.update(map(keyed.print_of, distinctive_words(piece)))
    return PublicPrints(frozenset(prints), frozenset(tokens), count)


def tell(fingerprinter: Fingerprinter, known: PublicPrints) -> None:
    """Make ``known`` the public texts ``fingerprinter``'s records leave out."""
    fingerprinter.public, fingerprinter.public_tokens = known.prints, known.tokens
