"""The documentation's code runs as written, and its navigation points at real pages.

Every ```python block of docs/*.md and docs/**/*.md runs; the blocks of one page run in
order in one namespace, so later blocks reuse names from earlier ones. The strict site
build itself is ``make docs``.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("MPLBACKEND", "Agg")

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """``(line, code)`` of every ```python block of ``page``, in order."""
    text = page.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        if match["lang"].strip().split(" ")[0] in ("python", "py"):
            line = text.count("\n", 0, match.start()) + 2
            blocks.append((line, textwrap.dedent(match["body"])))
    return blocks


def nav_pages(nav: list) -> list[str]:
    """Every page named in an mkdocs ``nav`` tree."""
    pages: list[str] = []
    for entry in nav:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            pages.extend(nav_pages(value) if isinstance(value, list) else [value])
    return pages


def load_mkdocs() -> dict:
    class Loader(yaml.SafeLoader):  # tolerate mkdocs' !!python/name and !ENV tags
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_code_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # snippets that write files write them here
    namespace: dict = {"__name__": "__docs__"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models; several threads only thrash on a busy machine
    start = time.perf_counter()
    try:
        for line, code in python_blocks(page):
            name = f"{page.relative_to(ROOT)}:{line}"
            try:
                exec(compile(code, name, "exec"), namespace)
            except Exception as error:
                raise AssertionError(f"the block at {name} failed: {type(error).__name__}: {error}") from error
    finally:
        torch.set_num_threads(threads)
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")
    print(f"{page.relative_to(ROOT)}: {time.perf_counter() - start:.2f} s")


def test_every_fence_is_closed_and_found() -> None:
    """An unclosed or oddly indented fence would silently hide code from the test above."""
    for page in PAGES:
        opening = len(re.findall(r"^[ \t]*```python", page.read_text(), re.M))
        assert opening == len(python_blocks(page)), page


def test_nav_pages_exist_and_every_page_is_in_the_nav() -> None:
    config = load_mkdocs()
    listed = nav_pages(config["nav"])
    missing = [p for p in listed if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml names pages that do not exist: {missing}"
    orphans = sorted(str(p.relative_to(DOCS)) for p in PAGES if str(p.relative_to(DOCS)) not in listed)
    assert not orphans, f"pages missing from mkdocs.yml's nav: {orphans}"


def test_images_exist_and_are_small() -> None:
    for page in PAGES:
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)", page.read_text()):
            image = (page.parent / target).resolve()
            assert image.is_file(), f"{page.relative_to(DOCS)} shows a missing image {target}"
            assert image.stat().st_size < 150 * 1024, f"{target} is over 150 KB"


# ---- every public callable documents every parameter, as the API pages parse it ----------------

API_MODULES = ["tdhook_fn", "tdhook_fn.attribution", "tdhook_fn.weights", "tdhook_fn.latent", "tdhook_fn.data"]
# The options mkdocs.yml gives mkdocstrings (docstring_style: google, docstring_options).
GOOGLE_OPTIONS = {"returns_named_value": False, "returns_multiple_items": False}
SPHINX_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj|exc):`")


def _public_callables() -> list[tuple[str, str]]:
    import importlib
    import inspect

    found = []
    for module_name in API_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isfunction(value) or inspect.isclass(value):
                found.append((module_name, name))
    return found


@pytest.fixture(scope="module")
def griffe_package():
    griffe = pytest.importorskip("griffe")
    return griffe.load("tdhook_fn", search_paths=[str(ROOT)], resolve_aliases=True, resolve_external=False)


class _Records(__import__("logging").Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize(("module", "name"), _public_callables(), ids=lambda v: v)
def test_every_parameter_is_documented(griffe_package, module: str, name: str) -> None:
    """Each signature parameter has its own ``Args:`` entry, and griffe parses the docstring without a warning."""
    import logging

    from griffe import DocstringSectionKind, Kind

    obj = griffe_package[module.removeprefix("tdhook_fn").lstrip(".") + ("." if module != "tdhook_fn" else "") + name]
    obj = obj.final_target if obj.is_alias else obj
    function = obj.members["__init__"] if obj.kind is Kind.CLASS and "__init__" in obj.members else obj
    assert obj.docstring is not None, f"{module}.{name} has no docstring"
    records = _Records()
    logger = logging.getLogger("griffe")
    logger.addHandler(records)
    try:
        sections = obj.docstring.parse("google", **GOOGLE_OPTIONS)
        if function is not obj and function.docstring is not None:  # merge_init_into_class
            sections += function.docstring.parse("google", **GOOGLE_OPTIONS)
    finally:
        logger.removeHandler(records)
    assert not records.messages, f"{module}.{name}: griffe warns: {records.messages}"
    kinds = {DocstringSectionKind.parameters}
    if obj.kind is Kind.CLASS:  # a dataclass's fields may be documented as its attributes
        kinds.add(DocstringSectionKind.attributes)
    documented = {p.name for s in sections if s.kind in kinds for p in s.value}
    for section in sections:
        text = {DocstringSectionKind.text: lambda: section.value,
                DocstringSectionKind.admonition: lambda: section.value.contents}.get(section.kind, str)()
        assert not re.search(r"^\s*>>>", text, re.M), f"{module}.{name}: a doctest outside an Examples: section"
        assert not SPHINX_ROLE.search(obj.docstring.value), f"{module}.{name}: a Sphinx role; use `name`"
        assert "NOTE [" not in obj.docstring.value, f"{module}.{name}: a source NOTE name in user docs"
    wanted = []
    for parameter in getattr(function, "parameters", []):
        if parameter.name in ("self", "cls"):
            continue
        star = {"var_positional": "*", "var_keyword": "**"}.get(parameter.kind.name if parameter.kind else "", "")
        wanted.append((parameter.name, star + parameter.name))
    missing = [shown for bare, shown in wanted if bare not in documented and shown not in documented]
    assert not missing, f"{module}.{name}: parameters without an Args entry: {missing}"


def test_pages_speak_to_users() -> None:
    """No source NOTE names, issue or commit numbers in the user docs: they mean nothing to a reader."""
    internal = re.compile(r"NOTE \[|\bissue #?\d+|\bcommit [0-9a-f]{7,40}\b|\bPR #?\d+", re.I)
    found = [f"{page.relative_to(DOCS)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}"
             for page in PAGES for text in [page.read_text()] for m in internal.finditer(text)]
    assert not found, f"internal references in docs/: {found}"
