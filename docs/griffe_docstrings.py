"""Griffe extension: render tdhook_fn's docstrings (Google style with Sphinx touches) as Markdown.

The library's docstrings are written for ``pytest --doctest-modules`` and for reading in
source; this rewrites, for the API pages only, what Markdown would otherwise garble:

- ``>>>`` doctest blocks become fenced ``pycon`` code;
- Sphinx roles (``:func:`params```, ``:class:`~a.B```) become optional cross-references
  (a link where the object is documented, plain code elsewhere);
- ``# NOTE [topic]`` lines become bold labels instead of headings, and a trailing ``::``
  (reST literal block) becomes ``:``;
- grouped entries in ``Args:`` (``a, b, c: as in f``, possibly over several lines) become
  one entry per name, so griffe matches each to the signature.

Registered in mkdocs.yml under the python handler's ``extensions``; the library is not
modified.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj|exc):`(~?)([\w.]+)`")
_NOTE = re.compile(r"^(\s*)# NOTE \[(.+)\]\s*$")
_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters):\s*$")


def _top_level_split(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _fence_doctests(lines: list[str]) -> list[str]:
    out: list[str] = []
    in_fence = in_doctest = False
    indent = ""
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("```"):
            in_fence = not in_fence
        if in_doctest and not stripped:
            out.append(indent + "```")
            in_doctest = False
        if not in_fence and not in_doctest and stripped.startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(indent + "```pycon")
            in_doctest = True
        out.append(line)
    if in_doctest:
        out.append(indent + "```")
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _expand_section(section: list[str]) -> list[str]:
    """The entries of one ``Args:`` section, grouped names expanded."""
    item_indent = min(_indent(line) for line in section if line.strip())
    entries: list[tuple[list[str], list[str]]] = []  # (head, continuation lines)
    for line in section:
        if line.strip() and _indent(line) == item_indent:
            head = entries[-1][0] if entries else []
            if head and head[-1].endswith(",") and len(_top_level_split(" ".join(head), ":")) == 1:
                head.append(line.strip())  # names listed over several lines
            else:
                entries.append(([line.strip()], []))
        elif entries:
            entries[-1][1].append(line)
    out: list[str] = []
    for head, cont in entries:
        name_part, *rest = _top_level_split(" ".join(head), ":")
        names = [n.strip() for n in _top_level_split(name_part, ",")]
        if len(names) > 1 and rest and all(re.fullmatch(r"\**\w+", n) for n in names):
            trailing = []
            while cont and not cont[-1].strip():
                trailing.append(cont.pop())
            for name in names:
                out.append(" " * item_indent + name + ":" + ":".join(rest))
                out.extend(cont)
            out.extend(trailing)
        else:
            out.append(" " * item_indent + " ".join(head))
            out.extend(cont)
    return out


def _expand_groups(lines: list[str]) -> list[str]:
    """One ``Args:`` entry per name for entries naming several parameters."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        header = _SECTION.match(lines[i])
        out.append(lines[i])
        i += 1
        if not header:
            continue
        end = i
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > len(header.group(1))):
            end += 1
        if any(line.strip() for line in lines[i:end]):
            out.extend(_expand_section(lines[i:end]))
        else:
            out.extend(lines[i:end])
        i = end
    return out


class TdhookDocstrings(griffe.Extension):
    """Rewrites every docstring as described in the module docstring."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        self.on_object(obj=pkg, loader=loader)  # a top-level package gets no on_object of its own

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is None or getattr(obj.docstring, "_tdhook_rewritten", False):
            return
        obj.docstring._tdhook_rewritten = True
        collection = loader.modules_collection

        def exists(path: str) -> bool:
            try:
                collection.get_member(path)
            except (KeyError, ValueError, AttributeError, griffe.AliasResolutionError):
                return False
            return True

        module = obj if obj.is_module else obj.module
        public = ".".join(part for part in module.path.split(".") if not part.startswith("_"))
        owner = obj.path if obj.is_class else (obj.parent.path if obj.parent is not None else module.path)

        def role(match: re.Match[str]) -> str:
            short, target = match.group(1), match.group(2)
            shown = target.rsplit(".", 1)[-1] if short else target
            candidates = [f"{public}.{target}", f"{owner}.{target}", f"{module.path}.{target}",
                          f"tdhook_fn.{target}", target]
            identifier = next((c for c in candidates if exists(c)), target)
            return f"<autoref identifier=\"{identifier}\" optional><code>{shown}</code></autoref>"

        lines = obj.docstring.value.splitlines()
        lines = _fence_doctests(lines)
        lines = [_NOTE.sub(r"\1**NOTE \\[\2\\]**", line) for line in lines]
        lines = [line[:-1] if line.endswith("::") and not line.strip().startswith(">>>") else line
                 for line in lines]
        lines = _expand_groups(lines)
        obj.docstring.value = _ROLE.sub(role, "\n".join(lines))
