"""The package's layering (docs/architecture.md, "Layers"), read from the source with ast: the kernels'
side (ops/, runtime/) never imports the tools built on it (bench/, cli.py), and no module imports a
private (underscore) name from another package of tilefish."""
from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "tilefish"
LOWER = ("ops", "runtime")
UPPER = ("tilefish.bench", "tilefish.cli")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    """tilefish.ops.w4a16.launch -> tilefish.ops; tilefish.nn -> tilefish.nn (a top-level module is its own)."""
    return ".".join(module.split(".")[:2])


def _from_target(path: pathlib.Path, node: ast.ImportFrom) -> str:
    """The module a `from ... import` names, relative imports resolved."""
    module = _module_name(path)
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    if node.level:
        return ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
    return node.module or ""


def _imports(path: pathlib.Path):
    """(imported module, names) of every import in the file, relative imports resolved."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            yield _from_target(path, node), tuple(a.name for a in node.names)


def _sources():
    return sorted(p for p in SRC.rglob("*.py") if "kernels" not in p.parts)


def test_ops_and_runtime_never_import_bench_or_cli():
    bad = []
    for path in _sources():
        if path.relative_to(SRC).parts[0] not in LOWER:
            continue
        for target, names in _imports(path):
            full = [target] + [f"{target}.{n}" for n in names]
            if any(t == up or t.startswith(up + ".") for t in full for up in UPPER):
                bad.append(f"{path.relative_to(SRC)} imports {target} {names}")
    assert not bad, bad


def _is_module(name: str) -> bool:
    path = SRC.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_name_is_used_across_packages():
    """Neither `from tilefish.X import _name` nor `module._name` on a module of another package."""
    bad = []
    for path in _sources():
        here = _package(_module_name(path))
        tree = ast.parse(path.read_text())
        modules = {}  # local name -> a tilefish module of another package
        for target, names in _imports(path):
            if not target.startswith("tilefish") or _package(target) == here:
                continue
            bad += [f"{path.relative_to(SRC)}: from {target} import {n}" for n in names if _private(n)]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _from_target(path, node)
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    if full.startswith("tilefish") and _is_module(full) and _package(full) != here:
                        modules[alias.asname or alias.name] = full
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("tilefish") and alias.asname and _package(alias.name) != here:
                        modules[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and _private(node.attr)):
                bad.append(f"{path.relative_to(SRC)}:{node.lineno}: {modules[node.value.id]}.{node.attr}")
    assert not bad, bad

