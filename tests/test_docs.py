"""The documentation's code runs as written, and its navigation points at real pages.

Every ```python block of docs/*.md and docs/**/*.md runs; the blocks of one page run in
order in one namespace, so later blocks reuse names from earlier ones. The strict site
build itself is ``make docs``.
"""

from __future__ import annotations

import importlib
import inspect
import logging
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

API_MODULES = ["tdhook_fn", "tdhook_fn.attribution", "tdhook_fn.attribution.metrics", "tdhook_fn.attribution.surrogate",
               "tdhook_fn.weights", "tdhook_fn.latent", "tdhook_fn.latent.dimension", "tdhook_fn.latent.probing",
               "tdhook_fn.latent.similarity", "tdhook_fn.data"]
# The options mkdocs.yml gives mkdocstrings (docstring_style: google, docstring_options).
GOOGLE_OPTIONS = {"returns_named_value": False, "returns_multiple_items": False}
SPHINX_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj|exc):`")
STAR = {"var_positional": "*", "var_keyword": "**"}  # how *args and **kwargs may be documented


def _public_callables() -> list[tuple[str, str]]:
    """``(module, name)`` of every function and class in the ``__all__`` of the API modules."""
    found = []
    for module_name in API_MODULES:
        module = importlib.import_module(module_name)
        found += [(module_name, name) for name in module.__all__
                  if inspect.isfunction(getattr(module, name)) or inspect.isclass(getattr(module, name))]
    return found


@pytest.fixture(scope="module")
def griffe_package():
    """tdhook_fn as mkdocstrings sees it: loaded by griffe from the source, statically."""
    griffe = pytest.importorskip("griffe")
    return griffe.load("tdhook_fn", search_paths=[str(ROOT)], resolve_aliases=True, resolve_external=False)


class _Messages(logging.Handler):
    """Collects what griffe logs (its docstring warnings) while installed on the ``griffe`` logger."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize(("module", "name"), _public_callables(), ids=lambda v: v)
def test_every_parameter_is_documented(griffe_package, module: str, name: str) -> None:
    """Each signature parameter has an ``Args:`` entry of its own, and griffe parses the docstring without a
    warning; examples sit in an ``Examples:`` section, names in backticks (no Sphinx roles), no NOTE names."""
    from griffe import DocstringSectionKind, Kind

    relative = f"{module}.{name}".removeprefix("tdhook_fn.")
    obj = griffe_package[relative]
    obj = obj.final_target if obj.is_alias else obj
    assert obj.docstring is not None, f"{module}.{name} has no docstring"
    init = obj.members.get("__init__") if obj.kind is Kind.CLASS else None
    signature = init if init is not None else obj
    messages = _Messages()
    logging.getLogger("griffe").addHandler(messages)
    try:
        sections = obj.docstring.parse("google", **GOOGLE_OPTIONS)
        if init is not None and init.docstring is not None:  # mkdocs.yml: merge_init_into_class
            sections += init.docstring.parse("google", **GOOGLE_OPTIONS)
    finally:
        logging.getLogger("griffe").removeHandler(messages)
    assert not messages.messages, f"{module}.{name}: griffe warns: {messages.messages}"

    assert not SPHINX_ROLE.search(obj.docstring.value), f"{module}.{name}: a Sphinx role; write `name`"
    assert "NOTE [" not in obj.docstring.value, f"{module}.{name}: a source NOTE name in user docs"
    for section in sections:
        text = {DocstringSectionKind.text: lambda: section.value,
                DocstringSectionKind.admonition: lambda: section.value.contents}.get(section.kind, str)()
        assert not re.search(r"^\s*>>>", text, re.M), f"{module}.{name}: a doctest outside an Examples: section"

    kinds = {DocstringSectionKind.parameters}
    if obj.kind is Kind.CLASS:  # a dataclass's fields may be documented as its attributes
        kinds.add(DocstringSectionKind.attributes)
    documented = {entry.name for section in sections if section.kind in kinds for entry in section.value}
    missing = []
    for parameter in getattr(signature, "parameters", []):
        shown = STAR.get(parameter.kind.name if parameter.kind else "", "") + parameter.name
        if parameter.name not in ("self", "cls") and not {parameter.name, shown} & documented:
            missing.append(shown)
    assert not missing, f"{module}.{name}: parameters without an Args entry: {missing}"


def test_pages_speak_to_users() -> None:
    """No source NOTE names, issue or commit numbers in the user docs: they mean nothing to a reader."""
    internal = re.compile(r"NOTE \[|\bissue #?\d+|\bcommit [0-9a-f]{7,40}\b|\bPR #?\d+", re.I)
    found = [f"{page.relative_to(DOCS)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}"
             for page in PAGES for text in [page.read_text()] for m in internal.finditer(text)]
    assert not found, f"internal references in docs/: {found}"
