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
