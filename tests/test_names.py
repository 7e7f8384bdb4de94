"""Every name the package's code reads is bound: pyflakes' undefined-name check over src/tilefish. A code path that
runs only on a GPU (most of ops/) is otherwise first executed on the device, where a NameError costs a device call.

pyflakes also flags a name a closure reads after the enclosing function `del`s it (the benches free their GPU
buffers that way once timed); those names are allowed where the same function deletes them."""
from __future__ import annotations

import ast
import pathlib

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes import messages, reporter  # noqa: E402

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "tilefish"


class _Collect(reporter.Reporter):
    def __init__(self):
        self.found = []

    def flake(self, message):
        self.found.append(message)

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.found.append(f"{filename}:{lineno}: syntax error: {msg}")

    def unexpectedError(self, filename, msg):
        self.found.append(f"{filename}: {msg}")


def _deleted_names(tree: ast.AST, lineno: int) -> set[str]:
    """Names a `del` deletes in the innermost function around line `lineno`."""
    funcs = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             and f.lineno <= lineno <= f.end_lineno]
    if not funcs:
        return set()
    inner = max(funcs, key=lambda f: f.lineno)
    return {t.id for d in ast.walk(inner) if isinstance(d, ast.Delete) for t in d.targets if isinstance(t, ast.Name)}


def test_every_name_read_is_bound():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        collect = _Collect()
        pyflakes_api.check(text, str(path), collect)
        tree = ast.parse(text)
        for m in collect.found:
            if isinstance(m, str):
                bad.append(m)
            elif isinstance(m, messages.UndefinedName) and m.message_args[0] not in _deleted_names(tree, m.lineno):
                bad.append(f"{path.relative_to(SRC.parent)}:{m.lineno}: undefined name {m.message_args[0]!r}")
    assert not bad, "\n".join(bad)
