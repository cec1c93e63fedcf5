"""Imports point down the parts, never up, and no two modules import each other.

The order (docs/explanation/code.md, "Reading the code"): the foundation (errors, records, and the other top-level
modules that import nothing above them) < trainers < storage < checkpoint < ranks < engine < views
< deploy < cli (with ``__main__`` and the public surface, ``trainjob/__init__.py``) < integrations
(the framework adapters, over the engine and the torch adapter; nothing imports them); ``trainers``
imports only the foundation and itself. Every import counts, including those inside functions and under
``TYPE_CHECKING``: a late import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "trainjob"
FOUNDATION = ("errors", "exits", "records", "states", "tensors", "defaults", "plain", "state_tree")
# A module may import its own part and any part of a lower rank.
RANK = {**dict.fromkeys(FOUNDATION, 0), "trainers": 1, "storage": 2, "checkpoint": 3, "ranks": 4,
        "engine": 5, "views": 6, "deploy": 7, "cli": 8, "__main__": 8, "": 8,
        "torch": 8, "integrations": 9}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def part(module: str) -> str:
    """``trainjob.engine.job`` -> ``engine``; ``trainjob.records`` -> ``records``; ``trainjob`` -> ``""``."""
    return module.split(".")[1] if "." in module else ""


def imports(module: str, *, ours: bool = True) -> list[tuple[int, str]]:
    """Every trainjob module (or with ``ours=False``, every module) ``module`` imports, with the
    line: ``from X import name`` counts as ``X.name`` when that is a module, else as ``X``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                found.append((node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base))
    return [(line, target) for line, target in found if not ours or target.split(".")[0] == "trainjob"]


def upward(module: str) -> list[str]:
    mine = part(module)
    bad = []
    for line, target in imports(module):
        theirs = part(target)
        if theirs == mine:
            continue
        allowed = RANK[theirs] == 0 if mine == "trainers" else RANK[theirs] <= RANK[mine] and theirs != ""
        if not allowed:
            bad.append(f"{module}:{line} imports {target} "
                       f"({theirs or 'the public surface'} is not below {mine or 'the public surface'})")
    return bad


def test_every_part_has_a_rank():
    assert {part(m) for m in MODULES} <= set(RANK), "a new part or foundation module: give it a RANK"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    assert upward(module) == []


def test_no_two_modules_import_each_other():
    """No import cycle, at any length: each module can be read knowing only what it imports."""
    graph = {m: {t for _, t in imports(m)} - {m} for m in MODULES}
    done: set[str] = set()

    def visit(m: str, stack: list[str]) -> None:
        if m in stack:
            raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(m):], m]))
        if m not in done:
            for t in sorted(graph[m]):
                visit(t, [*stack, m])
            done.add(m)

    for m in sorted(graph):
        visit(m, [])


def test_k8s_render_imports_neither_numpy_nor_transitions():
    """``k8s render`` takes the run's defaults from the foundation, not from the engine's RunConfig."""
    seen, todo, outside = set(), ["trainjob.deploy.k8s"], set()
    while todo:
        module = todo.pop()
        seen.add(module)
        for _, target in imports(module, ours=False):
            if target in MODULES:
                todo += [] if target in seen else [target]
            else:
                outside.add(target.split(".")[0])
    assert not outside & {"numpy", "transitions"}, sorted(seen)


def test_the_layer_check_sees_an_upward_import_inside_a_function(tmp_path, monkeypatch):
    """The check itself: a late import from a lower part into a higher one is reported."""
    fake = tmp_path / "trainjob" / "storage" / "fake.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from ..engine import job\n")
    monkeypatch.setitem(MODULES, "trainjob.storage.fake", fake)
    assert upward("trainjob.storage.fake") == [
        "trainjob.storage.fake:2 imports trainjob.engine.job (engine is not below storage)"]
