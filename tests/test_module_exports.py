"""Each module's ``__all__`` lists what the other modules of the package import from it.

An import of a name a module does not export (an underscore name, or one left out of
its ``__all__``) is a dependency nobody sees when reading that module.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tdhook_fn"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exports() -> dict[str, set[str]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                out[_module_name(path)] = set(ast.literal_eval(node.value))
    return out


def _imports() -> list[tuple[str, str, str]]:
    """``(importer, module, name)`` of every ``from <module of tdhook_fn> import name``."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        importer = _module_name(path)
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            elif (node.module or "").startswith("tdhook_fn"):
                module = node.module or ""
            else:
                continue
            found.extend((importer, module, alias.name) for alias in node.names)
    return found


def test_every_imported_name_is_exported():
    exports = _exports()
    modules = {_module_name(path) for path in PACKAGE.rglob("*.py")}
    hidden = sorted((importer, module, name) for importer, module, name in _imports()
                    if module in exports and name not in exports[module] and f"{module}.{name}" not in modules)
    assert hidden == []
