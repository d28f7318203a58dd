"""Every python block of the README runs as written, and the Quickstart's three lines are captum's.

The blocks run in order in one namespace (later blocks may reuse earlier names); the
Quickstart's attribution is then compared with captum 0.9's ``IntegratedGradients``.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path
from typing import Any

import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def readme_blocks() -> list[tuple[int, str]]:
    """``(line, code)`` of each ```python block of the README, in order."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in BLOCK.finditer(text)]


def run_readme() -> tuple[dict[str, Any], str]:
    namespace: dict[str, Any] = {"__name__": "readme"}
    out = io.StringIO()
    torch.manual_seed(0)
    with contextlib.redirect_stdout(out):
        for line, code in readme_blocks():
            exec(compile("\n" * (line - 1) + code, str(README), "exec"), namespace)
    return namespace, out.getvalue()


def quickstart() -> str:
    text = README.read_text()
    start = text.index("## Quickstart")
    return text[start : text.index("\n## ", start + 1)]


def test_the_readme_has_python_blocks_and_they_run():
    assert readme_blocks(), "the README has no ```python block"
    _, printed = run_readme()
    assert "torch.Size([5, 4]) torch.Size([2, 5, 3])" in printed


def test_the_quickstart_attributes_in_three_lines_without_shadowing_a_method():
    code = BLOCK.search(quickstart()).group(1)
    lines = [line for line in code.splitlines() if "tdhook_fn.pure(" in line or "target=pred" in line
             or "argmax(" in line]
    assert len(lines) == 3, lines
    assert "tdhook_fn.attribution" in code
    methods = {"saliency", "integrated_gradients", "grad_cam", "guided_backprop", "lrp"}
    stored = {node.id for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Name)
              and isinstance(node.ctx, ast.Store)}
    assert not methods & stored, f"the Quickstart rebinds {methods & stored}"


def test_the_quickstart_equals_captum_integrated_gradients():
    from captum.attr import IntegratedGradients

    ns, _ = run_readme()
    model, x, pred, attr = ns["model"], ns["x"], ns["pred"], ns["attr"]
    assert isinstance(attr, torch.Tensor) and attr.shape == x.shape
    expected = IntegratedGradients(model).attribute(x, target=pred)
    torch.testing.assert_close(attr, expected)
