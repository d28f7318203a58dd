"""Imports in one direction: no module of ``tdhook_fn`` (compat included) reaches itself again.

Imports under ``if TYPE_CHECKING:`` count too: a circle there is still a circle in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tdhook_fn

_ROOT = Path(tdhook_fn.__file__).parent
_PACKAGE = "tdhook_fn"


def _modules() -> dict[str, Path]:
    found = {}
    for path in _ROOT.rglob("*.py"):
        parts = path.relative_to(_ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((_PACKAGE, *parts))] = path
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            candidates = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found.update(c for c in candidates if c in known and c != name)
    return found


def _cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """One import path from ``start`` back to itself, if any."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, trail = stack.pop()
        for nxt in sorted(graph[node]):
            if nxt == start:
                return [*trail, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*trail, nxt]))
    return None


def test_the_package_has_no_import_circle() -> None:
    known = _modules()
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    circles = [cycle for name in sorted(graph) if (cycle := _cycle_from(name, graph)) is not None]
    assert circles == [], "import circles: " + "; ".join(" -> ".join(c) for c in circles)
