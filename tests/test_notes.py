"""Every ``NOTE [name]`` reference in the code resolves to exactly one note, a comment block.

A note is a comment line that starts with ``NOTE [name]``, alone or followed by ``:`` and
its text; every other mention of ``NOTE [name]`` is a reference to it. Notes are for
the people reading the code, so they live in comments, never in docstrings (which the
API pages show to users).
"""

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFINITION = re.compile(r"^\s*#\s*NOTE \[([^\]]+)\](?::|\s*$)")
HEADER = re.compile(r"^\s*(?:#\s*)?NOTE \[([^\]]+)\](?::|\s*$)", re.MULTILINE)
REFERENCE = re.compile(r"NOTE \[([^\]]+)\]")
SOURCES = ("tdhook_fn", "tests", "benchmarks", "examples", "docs")


def _notes() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    notes: dict[str, list[str]] = defaultdict(list)
    references: dict[str, list[str]] = defaultdict(list)
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                where = f"{path.relative_to(ROOT)}:{number}"
                note = DEFINITION.match(line)
                if note and folder == "tdhook_fn":
                    notes[note.group(1)].append(where)
                    line = line[note.end():]
                for name in REFERENCE.findall(line):
                    references[name].append(where)
    return notes, references


def test_every_note_is_defined_once():
    notes, _ = _notes()
    assert len(notes) > 50
    assert {name: places for name, places in notes.items() if len(places) > 1} == {}


def test_every_reference_names_a_note():
    notes, references = _notes()
    assert {name: places for name, places in references.items() if name not in notes} == {}


def test_notes_are_comments_not_docstrings():
    in_docstrings = []
    for path in sorted((ROOT / "tdhook_fn").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False) or ""
                in_docstrings += [f"{path.relative_to(ROOT)}: {name}" for name in HEADER.findall(doc)]
    assert in_docstrings == []


SPLIT = re.compile(r"NOTE(?:\s*$| \[[^\]\"]*$)")  # (not `"NOTE ["`, a string that looks for references)


def test_every_reference_is_on_one_line():
    """A reference broken over two lines reads as no reference: the tests above would not see it (nor a reader
    searching for the note's name)."""
    split = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            lines = enumerate(path.read_text().splitlines(), 1)
            split += [f"{path.relative_to(ROOT)}:{number}" for number, line in lines if SPLIT.search(line)]
    assert split == []
