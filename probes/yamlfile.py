"""Read kvcanary's YAML files and word what is wrong in them by key.

Shared by the monitor's config (``monitor/config/settings.py``) and the known-defects data file
(``probes/defects.py``); it lives in ``probes`` because ``probes`` never imports ``monitor``.

- :func:`load_yaml` parses like ``yaml.safe_load`` (merge keys ``<<`` included) but refuses a
  mapping key given twice at any depth, which plain YAML resolves by keeping the last one silently:
  :class:`DuplicateKeyError` names the key's path and both lines.
- :func:`error_lines` and :func:`key_path` turn a pydantic ``ValidationError`` into ``key: message``
  lines (``targets[0].interval_seconds: Input should be greater than 0``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml
from pydantic import ValidationError


class DuplicateKeyError(yaml.YAMLError):  # type: ignore[misc]  # PyYAML has no type hints here
    """A mapping key given twice; ``str()`` is ``<path>: key given twice, at lines <a> and <b>``."""

    def __init__(self, path: str, first_line: int, second_line: int) -> None:
        super().__init__(path, first_line, second_line)
        self.path = path
        self.lines = (first_line, second_line)

    def __str__(self) -> str:
        return f"{self.path}: key given twice, at lines {self.lines[0]} and {self.lines[1]}"


class UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]
    """``yaml.SafeLoader`` that raises :class:`DuplicateKeyError` for a mapping key given twice.

    Keys are compared as written (their tag and text), so ``1`` and ``"1"`` are two keys. A key
    that a merge (``<<: *base``) brings in and the mapping then states again is an override, not a
    duplicate, as in plain YAML; ``<<`` itself given twice in one mapping is a duplicate.
    """

    def construct_document(self, node: yaml.Node) -> Any:
        # Checked on the composed tree, before construction: only the whole tree knows each key's
        # path, and construct_mapping's flatten_mapping rewrites merged mappings in place, which
        # would make a merged key and its override look like a duplicate.
        _check_unique_keys(node, (), set())
        return super().construct_document(node)


def load_yaml(text: str) -> Any:
    """Return the YAML document in ``text``; raise DuplicateKeyError for a key given twice, and
    ``yaml.YAMLError`` (its base class) for anything else that is not YAML."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader: builds plain data only


def _check_unique_keys(node: yaml.Node, path: tuple[str | int, ...], visited: set[int]) -> None:
    """Raise DuplicateKeyError for the first key given twice in ``node``, in document order."""
    # An alias is the anchored node itself: visit each node once (aliases may even form a cycle).
    if id(node) in visited:
        return
    visited.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first_line: dict[tuple[str, Any], int] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                name = (key.tag, key.value)
                where = (*path, str(key.value))
                if name in first_line:
                    raise DuplicateKeyError(key_path(where), first_line[name], key.start_mark.line + 1)
                first_line[name] = key.start_mark.line + 1
            else:  # a complex key (``? [a, b]``): no path to name it by
                where = (*path, "?")
            _check_unique_keys(value, where, visited)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_unique_keys(item, (*path, index), visited)


def key_path(loc: Sequence[str | int], *, dotted_indices: bool = False) -> str:
    """Return ``loc`` as a key path, ``targets[0].probes`` (``targets.0.probes`` with
    ``dotted_indices``); ``""`` for the top level."""
    out = ""
    for part in loc:
        if isinstance(part, int) and not dotted_indices:
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def error_lines(
    exc: ValidationError, *, dotted_indices: bool = False, top_level: str | None = None
) -> list[str]:
    """Return one ``key: message`` line per distinct error of ``exc``, in pydantic's order.

    The key is :func:`key_path` of the error's location without pydantic's validator and literal
    wrappers (``function-after[...]``); the message drops pydantic's ``Value error, `` prefix. An
    error of the whole model reads ``<top_level>: message``, or ``message`` when top_level is None.
    """
    lines = []
    for err in exc.errors():
        loc = [p for p in err["loc"] if not str(p).startswith(("function-", "literal["))]
        key = key_path(loc, dotted_indices=dotted_indices) or top_level
        message = err["msg"].removeprefix("Value error, ")
        lines.append(f"{key}: {message}" if key else message)
    return list(dict.fromkeys(lines))
