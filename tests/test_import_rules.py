"""The layers' import rule, read from the source with ast (nothing is imported): ops -> torch, triton, the standard
library (not its benchmark-lab modules: subprocess, time, datetime, ...) and moe_tune.ops; engine -> ops and
profiles, never cli; profiles -> nothing of ours above it; cli -> engine and profiles, never ops. Imports inside
functions and under TYPE_CHECKING count too. And engine's modules import each other without a cycle, so its layers
read top-down."""

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "engine", "ops", "profiles")

# Per package: the modules of ours it may import, and the third-party top-level modules it may import (None: any).
RULES = {
    "ops": (("moe_tune.ops",), ("torch", "triton")),
    "engine": (("moe_tune.engine", "moe_tune.ops", "moe_tune.profiles"), None),
    "profiles": (("moe_tune.profiles",), None),
    "cli": (("moe_tune.cli", "moe_tune.engine", "moe_tune.profiles"), None),
}
# Standard-library modules of a benchmark lab, not of a kernel library: processes, clocks, dates, machine facts, result
# files and command lines belong to engine/bench, so ops/ imports none of them.
LAB_STDLIB = {"ops": ("argparse", "csv", "datetime", "json", "platform", "subprocess", "time", "timeit")}
RULE_TEXT = {
    "ops": "ops/ imports only torch, triton, the standard library (none of the lab's: engine/bench) and moe_tune.ops",
    "engine": "engine/ imports moe_tune.engine, moe_tune.ops and moe_tune.profiles, never moe_tune.cli",
    "profiles": "profiles/ imports nothing of ours but moe_tune.profiles",
    "cli": "cli/ imports moe_tune.engine and moe_tune.profiles (ops only behind engine)",
}


def module_name(path: Path) -> tuple[str, bool]:
    """`engine/model/attention.py` -> ("moe_tune.engine.model.attention", False); a package's __init__ -> its name."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return "moe_tune." + ".".join(parts), is_package


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute module names one import statement names (`from X import y` also names X.y: y may be a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module
    return [source] + [f"{source}.{alias.name}" for alias in node.names]


def all_imports(path: Path):
    """(line, absolute module name) for every import in the file, at any depth."""
    module, is_package = module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = imported_names(node, module, is_package)
            if isinstance(node, ast.ImportFrom):
                # `from X import y` is judged by X (y shares X's package), `from moe_tune import y` by moe_tune.y.
                names = names[1:] if names[0] == "moe_tune" else names[:1]
            for name in names:
                yield node.lineno, name


def is_ours(name: str) -> bool:
    return name == "moe_tune" or name.startswith("moe_tune.")


def violation(package: str, name: str) -> bool:
    allowed_ours, allowed_third_party = RULES[package]
    if is_ours(name):
        return not any(name == prefix or name.startswith(prefix + ".") for prefix in allowed_ours)
    top = name.split(".")[0]
    if top in LAB_STDLIB.get(package, ()):
        return True
    if top in sys.stdlib_module_names or allowed_third_party is None:
        return False
    return top not in allowed_third_party


def violations(package: str) -> list[str]:
    found = []
    for path in sorted((REPO / package).rglob("*.py")):
        for line, name in all_imports(path):
            if violation(package, name):
                found.append(f"{path.relative_to(REPO)}:{line}: imports {name} ({RULE_TEXT[package]})")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_each_layer_imports_only_what_its_rule_allows(package):
    assert list((REPO / package).rglob("*.py")), f"{package}/ has no modules: the test would check nothing"
    found = violations(package)
    assert not found, "\n" + "\n".join(found)


@pytest.mark.parametrize(("package", "name", "is_violation"), [
    ("ops", "fla.ops.kda", True),  # a third-party kernel library
    ("ops", "numpy", True),
    ("ops", "moe_tune.engine.model", True),
    ("ops", "moe_tune", True),
    ("ops", "math", False),  # the standard library
    ("ops", "subprocess", True),  # ... but not the benchmark lab's part of it
    ("ops", "datetime", True),
    ("ops", "time", True),
    ("engine", "subprocess", False),
    ("ops", "triton.language", False),
    ("ops", "moe_tune.ops.common", False),
    ("engine", "moe_tune.cli", True),
    ("engine", "moe_tune.cli._common", True),
    ("engine", "moe_tune.client", True),  # a prefix of a name is not the package
    ("engine", "fla.ops.kda", False),
    ("engine", "moe_tune.profiles.schema", False),
    ("profiles", "moe_tune.engine.data", True),
    ("profiles", "moe_tune.ops", True),
    ("profiles", "transformers", False),
    ("cli", "moe_tune.ops.moe", True),
    ("cli", "moe_tune.engine.bench", False),
])
def test_the_rule_judges_each_kind_of_import(package, name, is_violation):
    assert violation(package, name) is is_violation


def test_relative_and_nested_imports_are_resolved_and_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "ops" / "moe").mkdir(parents=True)
    (tmp_path / "ops" / "__init__.py").write_text("")
    (tmp_path / "ops" / "moe" / "__init__.py").write_text("from .kernels import moe_fwd\n")
    (tmp_path / "ops" / "moe" / "kernels.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ...engine import model\n"
        "def f():\n    import os, fla\n    from ..common import jit\n"
    )
    assert violations("ops") == [
        f"ops/moe/kernels.py:3: imports moe_tune.engine ({RULE_TEXT['ops']})",
        f"ops/moe/kernels.py:5: imports fla ({RULE_TEXT['ops']})",
    ]


def import_graph(package: str) -> dict[str, dict[str, int]]:
    """module -> {module of the same package it imports: first line}. Imports inside functions and under
    TYPE_CHECKING count: a deferred import hides a loop from the interpreter, not from a reader."""
    paths = {module_name(path)[0]: path for path in (REPO / package).rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        _, is_package = module_name(path)
        edges = graph[module] = {}
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))):
            for name in imported_names(node, module, is_package):
                # A package's submodule importing its own package (for a sibling) is no cycle of the layers.
                if name in paths and name != module and not module.startswith(name + "."):
                    edges[name] = min(edges.get(name, node.lineno), node.lineno)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state = {}
    stack = []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_engine_imports_have_no_cycle():
    graph = import_graph("engine")
    cycle = find_cycle(graph)
    if cycle:
        steps = [f"{a.removeprefix('moe_tune.')}:{graph[a][b]} imports {b.removeprefix('moe_tune.')}"
                 for a, b in zip(cycle, cycle[1:])]
        pytest.fail("engine's imports form a cycle (its layers must read top-down):\n" + "\n".join(steps))


def subpackage(module: str) -> str:
    """moe_tune.engine.model.attention -> "model"; a module directly in engine (moe_tune.engine.plan) is its own."""
    return module.split(".")[2] if module.count(".") >= 2 else module


def test_engine_model_reads_top_down():
    # At the level of engine's sub-packages too: nothing that engine/model imports (the expert layout and context
    # groups in engine/parallel, the memory tiers in engine/memory, ...) imports engine/model back; what walks or
    # builds a model (the planner, the experts' ZeRO tags, the trainer) sits above it.
    graph = import_graph("engine")
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(subpackage(module), set()).update(subpackage(target) for target in targets)
    # DecodeStep, under TYPE_CHECKING only: test_model_imports_generate_for_types_only.
    packages["model"].discard("generate")
    below, frontier = set(), {"model"}
    while frontier:  # every package model reaches, directly or through another
        frontier = {target for package in frontier for target in packages.get(package, ())} - below - {"model"}
        below |= frontier
    back = sorted(f"{module.removeprefix('moe_tune.')}:{line} imports {target.removeprefix('moe_tune.')}"
                  for module, targets in graph.items() if subpackage(module) in below
                  for target, line in targets.items() if subpackage(target) == "model")  # fmt: skip
    assert not back, f"engine/model imports {sorted(below)}, which import it back:\n" + "\n".join(back)


def test_model_imports_generate_for_types_only():
    # engine/generate drives a built model; engine/model names its DecodeStep in annotations only.
    for path in sorted((REPO / "engine" / "model").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                       for node in ast.walk(block)}  # fmt: skip
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe_tune.engine.generate"):
                assert id(node) in typing_only, f"{path.relative_to(REPO)}:{node.lineno} imports engine/generate"


def test_a_cycle_is_found():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 2, "b": 3}}) is None


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# (importing file, module) pairs whose private names wait for that module's split into public shared helpers.
PRIVATE_IMPORTS_PENDING: set[tuple[str, str]] = set()


def private_uses(path: Path) -> list[tuple[int, str, str]]:
    """(line, module of ours, private name) for every `from M import _x` (parenthesized too, at any depth) and every
    `m._x` where m is a module of ours bound by an import in the file; dunder names are no private names."""
    module, is_package = module_name(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    found, bound = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = imported_names(node, module, is_package)[0]
            for alias in node.names:
                if is_ours(source) and is_private(alias.name):
                    found.append((node.lineno, source, alias.name))
                bound[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                # `import a.b` binds a, `import a.b as m` binds m to a.b.
                top = alias.name.split(".")[0]
                bound[alias.asname or top] = alias.name if alias.asname else top
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and isinstance(node.value, ast.Name):
            target = bound.get(node.value.id)
            if target and is_ours(target) and target != module:
                found.append((node.lineno, target, node.attr))
    return sorted(found)


def private_imports(packages=PACKAGES) -> tuple[list[str], set[tuple[str, str]]]:
    """The uses of another module's private names (file:line lines), and the pending pairs that were met."""
    found, met = [], set()
    for package in packages:
        for path in sorted((REPO / package).rglob("*.py")):
            relative = str(path.relative_to(REPO))
            for line, source, name in private_uses(path):
                if (relative, source) in PRIVATE_IMPORTS_PENDING:
                    met.add((relative, source))
                    continue
                found.append(f"{relative}:{line}: uses {source}'s private {name} (make it public in {source})")
    return found, met


def test_no_module_uses_another_modules_private_names():
    found, met = private_imports()
    assert not found, "\n" + "\n".join(found)
    stale = PRIVATE_IMPORTS_PENDING - met
    assert not stale, f"no longer pending, drop them from PRIVATE_IMPORTS_PENDING: {sorted(stale)}"


def test_private_imports_are_found_in_every_form(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "engine" / "bench").mkdir(parents=True)
    (tmp_path / "engine" / "bench" / "steps.py").write_text(
        "from __future__ import annotations\n"
        "from moe_tune.engine.train.trainer import (\n    build,\n    _update,\n)\n"
        "from .kernels import _timed as timed, __version__\n"
        "import moe_tune.engine.train.trainer as trainer\n"
        "from moe_tune.engine.bench import moe_op\n"
        "import torch\n"
        "def f():\n    from moe_tune.profiles import _format\n"
        "    return trainer._noise(), moe_op._commit, moe_op.__name__, torch._grouped_mm, moe_op.public\n"
    )
    found, met = private_imports(("engine",))
    assert met == set()
    assert found == [
        "engine/bench/steps.py:2: uses moe_tune.engine.train.trainer's private _update "
        "(make it public in moe_tune.engine.train.trainer)",
        "engine/bench/steps.py:6: uses moe_tune.engine.bench.kernels's private _timed "
        "(make it public in moe_tune.engine.bench.kernels)",
        "engine/bench/steps.py:11: uses moe_tune.profiles's private _format (make it public in moe_tune.profiles)",
        "engine/bench/steps.py:12: uses moe_tune.engine.bench.moe_op's private _commit "
        "(make it public in moe_tune.engine.bench.moe_op)",
        "engine/bench/steps.py:12: uses moe_tune.engine.train.trainer's private _noise "
        "(make it public in moe_tune.engine.train.trainer)",
    ]
