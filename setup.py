"""Build kvcanary's wheel with the repository's top-level folders under one ``kvcanary`` package.

The repository keeps ``monitor/``, ``probes/``, ``workers/``, ``migrations/``, ``alerts/`` and
``dashboards/`` at the top, importing each other by those names. Installed under those names they
would clobber any other distribution's ``monitor`` or ``workers``, so the wheel maps each folder to
``kvcanary.<folder>`` (``package_dir``) and :class:`build_py` rewrites, in the built copies only,
every import of them (:func:`namespaced`). Metadata, dependencies and package data stay in
``pyproject.toml``; the console script is ``kvcanary.cli:main``, which both layouts can import.

An editable install (``pip install -e .``) keeps the repository's layout instead
(:class:`editable_wheel`): ``monitor``, ``probes``, ``workers`` and the ``kvcanary`` shim, served
from the checkout as they are.

The module imports cleanly (``setup()`` runs only as a script) so that tests can call
:func:`namespaced`.
"""

from __future__ import annotations

import ast
import io
import shutil
import tokenize
from collections.abc import Collection, Iterator
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py as _build_py
from setuptools.command.editable_wheel import editable_wheel as _editable_wheel

NAMESPACE = "kvcanary"
#: The repository's top-level folders that the wheel installs under ``kvcanary``.
ROOTS = ("monitor", "probes", "workers", "migrations", "alerts", "dashboards")
#: Folders without ``__init__.py`` (migration scripts, data) that are installed all the same.
FOLDERS = ("migrations", "migrations.versions", "alerts")
#: What an editable install imports from the checkout: the repository's own layout.
EDITABLE_PACKAGES = ("kvcanary", "monitor", "probes", "workers")


class NamespaceError(ValueError):
    """An import that :func:`namespaced` cannot rewrite in place; the message names the line."""


def wheel_packages() -> list[str]:
    """Return the wheel's packages: ``kvcanary`` and every repository folder named under it."""
    found = find_packages(include=[f"{root}{suffix}" for root in ROOTS for suffix in ("", ".*")])
    own = find_packages(include=[NAMESPACE, f"{NAMESPACE}.*"])  # the shim and the gateway tap
    return [*own, *(f"{NAMESPACE}.{name}" for name in sorted({*found, *FOLDERS}))]


def _root(module: str | None) -> str:
    return (module or "").partition(".")[0]


def _import_statements(names: list[ast.alias], roots: Collection[str], namespace: str) -> Iterator[str]:
    """Yield statements that bind what ``import <names>`` binds, with ``roots`` under ``namespace``."""
    for alias in names:
        name, root = alias.name, _root(alias.name)
        as_ = f" as {alias.asname}" if alias.asname else ""
        if root not in roots:
            yield f"import {name}{as_}"
        elif "." not in name:  # import monitor [as m]
            yield f"from {namespace} import {name}{as_}"
        elif alias.asname:  # import monitor.x as m
            yield f"import {namespace}.{name}{as_}"
        else:  # import monitor.x: loads monitor.x and binds `monitor` (and, here, `kvcanary` too)
            yield f"import {namespace}.{name}"
            yield f"from {namespace} import {root}"


def namespaced(source: str, roots: Collection[str] = ROOTS, namespace: str = NAMESPACE) -> str:
    """Return ``source`` with every absolute import of a ``roots`` module moved under ``namespace``.

    Only import statements change, and every line stays where it was (tracebacks from the wheel
    point at the repository's line numbers):

    - ``from monitor.x import y`` becomes ``from kvcanary.monitor.x import y``; only the module name
      is replaced, so parentheses, aliases and comments stay as written;
    - ``import monitor [as m]`` becomes ``from kvcanary import monitor [as m]``;
    - ``import monitor.x as m`` becomes ``import kvcanary.monitor.x as m``;
    - ``import monitor.x`` becomes ``import kvcanary.monitor.x; from kvcanary import monitor``.

    Left alone: strings and comments (``mock.patch("monitor.x")``, ``python -m workers`` in help
    texts, logger names), ``importlib.import_module`` and ``__import__`` calls, relative imports,
    and other modules that merely share a prefix (``monitoring``). Raise :class:`NamespaceError`
    for an ``import`` statement continued over several lines, which cannot keep its lines.
    """
    line_starts = [0]
    for line in source.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    lines = source.splitlines(keepends=True)

    def offset(lineno: int, byte_col: int) -> int:
        # ast columns count UTF-8 bytes; string slicing counts characters.
        return line_starts[lineno - 1] + len(lines[lineno - 1].encode()[:byte_col].decode())

    edits: list[tuple[int, int, str]] = []
    from_statements: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _root(node.module) in roots:
            from_statements.add(offset(node.lineno, node.col_offset))
        elif isinstance(node, ast.Import) and any(_root(a.name) in roots for a in node.names):
            if node.end_lineno != node.lineno:
                raise NamespaceError(f"line {node.lineno}: write this import on one line to namespace it")
            assert node.end_col_offset is not None
            start, end = offset(node.lineno, node.col_offset), offset(node.lineno, node.end_col_offset)
            edits.append((start, end, "; ".join(_import_statements(node.names, roots, namespace))))
    edits.extend(_from_module_edits(source, line_starts, from_statements, namespace))
    for start, end, text in sorted(edits, reverse=True):
        source = source[:start] + text + source[end:]
    return source


def _from_module_edits(
    source: str, line_starts: list[int], statements: set[int], namespace: str
) -> Iterator[tuple[int, int, str]]:
    """Yield an edit of the dotted module name of each ``from`` statement starting at ``statements``."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, token in enumerate(tokens):
        start = line_starts[token.start[0] - 1] + token.start[1]
        if token.string != "from" or start not in statements:
            continue
        j = i + 1
        while tokens[j].string != "import":
            j += 1
        first, last = tokens[i + 1], tokens[j - 1]
        if first.start[0] != last.end[0]:
            raise NamespaceError(f"line {first.start[0]}: write this module name on one line to namespace it")
        module = "".join(t.string for t in tokens[i + 1 : j])
        yield (
            line_starts[first.start[0] - 1] + first.start[1],
            line_starts[last.end[0] - 1] + last.end[1],
            f"{namespace}.{module}",
        )


class build_py(_build_py):  # type: ignore[misc]  # setuptools is untyped here
    """Build the wheel's modules with their imports namespaced (:func:`namespaced`)."""

    def run(self) -> None:
        if not self.editable_mode:
            # An in-tree build/ folder outlives builds: never let a stale or old-layout copy ship.
            for name in (NAMESPACE, *ROOTS):
                shutil.rmtree(Path(self.build_lib, name), ignore_errors=True)
        super().run()

    def build_module(self, module: str, module_file: str, package: str | list[str]) -> tuple[str, bool]:
        outfile, copied = super().build_module(module, module_file, package)
        built = Path(outfile)
        source = built.read_text(encoding="utf-8")
        try:
            rewritten = namespaced(source)
        except NamespaceError as exc:
            raise NamespaceError(f"{module_file}: {exc}") from None
        if rewritten != source:
            built.write_text(rewritten, encoding="utf-8")
        return outfile, copied


class editable_wheel(_editable_wheel):  # type: ignore[misc]
    """Install the checkout as it is: ``monitor``, ``probes``, ``workers`` and ``kvcanary`` from the tree."""

    def finalize_options(self) -> None:
        self.distribution.packages = find_packages(
            include=[f"{name}{suffix}" for name in EDITABLE_PACKAGES for suffix in ("", ".*")]
        )
        self.distribution.package_dir = {}
        super().finalize_options()


if __name__ == "__main__":
    setup(
        packages=wheel_packages(),
        package_dir={f"{NAMESPACE}.{root}": root for root in ROOTS},
        cmdclass={"build_py": build_py, "editable_wheel": editable_wheel},
    )
