"""Imports go one way: helpers at the bottom, the trainer core above the components it composes,
the comparison harness above runs.

    utils (helpers everything uses)                          layer 0
    models, optimizer, loaders (the components)              layer 1
    trainer (the step, metrics, hooks, resume, inference)    layer 2
    compare (the harness, an application above runs)         layer 3

A module may import its own layer and the layers below it, never above, at module level or inside
a function alike (imports under `if TYPE_CHECKING:` only name types and are not counted). The
validation boundary (utils/config.py, with utils/cli.py, which turns a command line into it)
reads every component's config, so it may import up to the trainer, and only the trainer and
above may import it. Entry points (train_jax.py, scripts/, bench/, tests/, docs/) import anything.
"""

from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = {"utils": 0, "models": 1, "optimizer": 1, "loaders": 1, "trainer": 2, "compare": 3}
BOUNDARY = {"utils.config", "utils.cli"}
BOUNDARY_LAYER = 2  # imports up to the trainer's configs; importable from the trainer up


def module_name(path: str) -> str:
    rel = os.path.relpath(path, REPO)[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def package_modules():
    for package in LAYERS:
        for root, dirs, names in os.walk(os.path.join(REPO, package)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in sorted(names):
                if name.endswith(".py"):
                    yield os.path.join(root, name)


def imported(tree: ast.AST, current: str) -> list[tuple[int, str]]:
    """(line, module) of every import outside `if TYPE_CHECKING:` blocks, relative ones resolved."""
    found = []

    def visit(node):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = current.split(".")[: -node.level]
                base = ".".join(parts + ([base] if base else []))
            found.append((node.lineno, base))
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def layer(module: str) -> float | None:
    """The layer of one of ours (None: a library). The boundary modules sit at BOUNDARY_LAYER."""
    if any(module == b or module.startswith(b + ".") for b in BOUNDARY):
        return BOUNDARY_LAYER
    return LAYERS.get(module.split(".")[0])


def violations(path: str, source: str) -> list[str]:
    current = module_name(path)
    own = layer(current)
    bad = []
    for line, target in imported(ast.parse(source), current):
        theirs = layer(target)
        if theirs is None or target.split(".")[0] == current.split(".")[0] and theirs == own:
            continue
        boundary_target = any(target == b or target.startswith(b + ".") for b in BOUNDARY)
        if theirs > own or (boundary_target and own < BOUNDARY_LAYER):
            where = f"{os.path.relpath(path, REPO)}:{line}"
            bad.append(f"{where}: {current} (layer {own}) imports {target} (layer {theirs})")
    return sorted(set(bad))


def test_imports_go_one_way():
    bad = []
    for path in package_modules():
        with open(path, encoding="utf-8") as f:
            bad += violations(path, f.read())
    assert not bad, "imports against the layering (tests/test_layering.py docstring):\n" + "\n".join(bad)


@pytest.mark.parametrize("where, source, flagged", [
    ("utils/x.py", "from trainer import step\n", True),              # a helper reaching up
    ("utils/x.py", "def f():\n    import models\n", True),            # inside a function too
    ("models/x.py", "from utils.config import validate\n", True),      # the boundary from below
    ("trainer/x.py", "from utils.config import RunConfig\n", False),   # the boundary from above
    ("utils/config.py", "from trainer.loss_scale import C\n", False),  # the boundary reads configs
    ("trainer/x.py", "import compare\n", True),                        # runs never import the harness
    ("models/x.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainer import step\n", False),
    ("compare/x.py", "from optimizer import OPTIMIZERS\n", False),
])
def test_the_check_flags_what_it_should(where, source, flagged):
    assert bool(violations(os.path.join(REPO, where), source)) == flagged
