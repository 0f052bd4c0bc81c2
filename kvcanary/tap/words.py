"""How the tap reads a text: code points, words, and lower case, by rules that need no Unicode
database but the two small tables below, so that a tap in Go, Rust or JavaScript cuts and folds
every text exactly as this one does whatever Unicode version its standard library knows
(``docs/tap-protocol.md``, "Reading a text").

- **Code points.** A text is a sequence of Unicode code points; a surrogate (U+D800-U+DFFF), which
  no well-formed text holds but a JSON escape or a JavaScript string can, is read as U+FFFD.
  Lengths are counted in code points, never in UTF-16 units or bytes.
- **Words.** The maximal runs of word characters. A word character is any code point that is not
  a separator, and the separators are ``SEPARATOR_RANGES``: ASCII's controls, space and
  punctuation, Latin-1's symbols and punctuation, the punctuation of the scripts that write it
  apart (Greek, Armenian, Hebrew, Arabic, Devanagari, Thai, Ethiopic, Khmer, Mongolian, CJK), the
  general punctuation, currency, arrow, mathematical, technical, box-drawing and dingbat blocks,
  variation selectors, the BOM, fullwidth punctuation, the specials (U+FFFD among them),
  emoji and tags. Letters, digits, the underscore and combining marks of every script are word
  characters, so a Devanagari word with its vowel signs, or a letter and its combining accent, is
  one word.
- **Lower case.** A code point in ``CASE_RANGES`` (Latin, Greek, Cyrillic, Armenian, the Latin and
  Greek extended blocks, letterlike symbols and number forms, fullwidth Latin) becomes its simple
  lowercase mapping (UnicodeData.txt's field 13, one code point, no context: the same in every
  Unicode version since 7.0 within these ranges), and two more: U+0130 (``İ``) becomes ``i``
  (its simple mapping; the full one adds a combining dot) and U+03C2 (final sigma) becomes U+03C3 (sigma), so
  that a Greek word compares alike wherever its sigma falls. Every other code point is kept.
  Lower-casing never turns a word character into a separator or back, so it may be applied to a
  text or to its words alike.
"""

from __future__ import annotations

import re

from kvcanary.wire import char_class

#: Code points that are no word's (inclusive ranges, in order).
SEPARATOR_RANGES = (
    (0x0000, 0x002F), (0x003A, 0x0040), (0x005B, 0x005E), (0x0060, 0x0060), (0x007B, 0x00BF),
    (0x00D7, 0x00D7), (0x00F7, 0x00F7), (0x037E, 0x037E), (0x0387, 0x0387), (0x055A, 0x055F),
    (0x0589, 0x058A), (0x05BE, 0x05BE), (0x05C0, 0x05C0), (0x05C3, 0x05C3), (0x05C6, 0x05C6),
    (0x05F3, 0x05F4), (0x0600, 0x060F), (0x061B, 0x061F), (0x066A, 0x066D), (0x06D4, 0x06D4),
    (0x06DD, 0x06DE), (0x0964, 0x0965), (0x0970, 0x0970), (0x0E3F, 0x0E3F), (0x0E4F, 0x0E4F),
    (0x0E5A, 0x0E5B), (0x10FB, 0x10FB), (0x1360, 0x1368), (0x1680, 0x1680), (0x169B, 0x169C),
    (0x16EB, 0x16ED), (0x17D4, 0x17D6), (0x17D8, 0x17DB), (0x1800, 0x180A), (0x180E, 0x180E),
    (0x2000, 0x206F), (0x20A0, 0x20CF), (0x2190, 0x2BFF), (0x2E00, 0x2E7F), (0x3000, 0x3004),
    (0x3008, 0x3020), (0x3030, 0x3030), (0x303D, 0x303F), (0xFD3E, 0xFD3F), (0xFE00, 0xFE19),
    (0xFE30, 0xFE6F), (0xFEFF, 0xFEFF), (0xFF01, 0xFF0F), (0xFF1A, 0xFF20), (0xFF3B, 0xFF40),
    (0xFF5B, 0xFF65), (0xFFF0, 0xFFFF), (0x1F000, 0x1FBFF), (0xE0000, 0xE007F),
)  # fmt: skip
#: Code points lower-cased by their simple lowercase mapping (inclusive ranges).
CASE_RANGES = (
    (0x0041, 0x024F), (0x0370, 0x052F), (0x0531, 0x0556), (0x1E00, 0x1FFF), (0x2100, 0x218F),
    (0xFF21, 0xFF3A),
)  # fmt: skip
#: The mappings besides the simple ones: İ's simple mapping (Python's ``lower`` gives the full
#: one, two code points), and the final sigma read as the sigma.
EXTRA_LOWER = {0x0130: 0x0069, 0x03C2: 0x03C3}


def _lowercase_table() -> dict[int, int]:
    """Return every code point the rule changes and what it becomes (Python's own per-character
    ``lower`` is the simple mapping in these ranges, but for U+0130)."""
    table: dict[int, int] = {}
    for first, last in CASE_RANGES:
        for code in range(first, last + 1):
            lowered = chr(code).lower()
            if len(lowered) == 1 and lowered != chr(code):
                table[code] = ord(lowered)
    return table | EXTRA_LOWER


#: Every change the lower-case rule makes (about 740 code points).
LOWERCASE = _lowercase_table()


#: What the rule makes of the code points whose lower case ``str.lower`` makes otherwise within the
#: case ranges: U+0130 (``str.lower`` adds a combining dot), U+03A3 (it chooses the final sigma by
#: context) and U+03C2 (it keeps the final sigma). Each is made so before ``str.lower`` runs.
_FIRST = {0x0130: "i", 0x03A3: "\u03c3", 0x03C2: "\u03c3"}
_FIRST_RE = re.compile("[\u0130\u03a3\u03c2]")


def _lowered_elsewhere() -> list[tuple[int, int]]:
    """Return the code points outside the case ranges that ``str.lower`` changes and the rule keeps
    (Georgian Mtavruli, Cherokee, Deseret, Glagolitic, ...), as inclusive ranges."""
    found: list[tuple[int, int]] = []
    for code in range(0x20000):  # no script past plane 1 has case
        if 0xD800 <= code <= 0xDFFF or code in LOWERCASE or chr(code).lower() == chr(code):
            continue
        if found and found[-1][1] == code - 1:
            found[-1] = (found[-1][0], code)
        else:
            found.append((code, code))
    return found


#: A text holding none of these is lower-cased by ``str.lower`` in C; one that does, a code point at
#: a time (about twice as slow).
_ELSEWHERE_RE = re.compile(f"[{char_class(_lowered_elsewhere())}]")
_WORD_RE = re.compile(f"[^{char_class(SEPARATOR_RANGES)}]+")
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def scalars(text: str) -> str:
    """Return ``text`` with each surrogate read as U+FFFD: a sequence of Unicode scalar values,
    which UTF-8 can write."""
    if text.isascii():  # a flag of the string: no scan
        return text
    return _SURROGATE_RE.sub("\ufffd", text)


def lower(text: str) -> str:
    """Return ``text`` lower-cased by the rule (the module doc): by ``str.lower``, once the three
    code points it maps otherwise in the case ranges are made as the rule makes them, unless the
    text holds one it lower-cases outside them; then a code point at a time."""
    if text.isascii():
        return text.lower()
    if _ELSEWHERE_RE.search(text) is not None:
        return text.translate(LOWERCASE)
    if _FIRST_RE.search(text) is not None:
        text = _FIRST_RE.sub(lambda m: _FIRST[ord(m.group(0))], text)
    return text.lower()


def words(text: str) -> list[str]:
    """Return the words of ``text`` (scalar values), case kept, in order."""
    return _WORD_RE.findall(text)


def is_separator(code: int) -> bool:
    """Whether the code point ``code`` is no word's."""
    return any(first <= code <= last for first, last in SEPARATOR_RANGES)
