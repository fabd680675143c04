"""The planner's core (problem, cost model, solvers) imports no torch, DeepSpeed or torch.distributed.

The check reads the source with :mod:`ast`, following the core's imports inside
``ds_pipe_ckpt``, so it needs neither torch nor ranks.
"""

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "ds_pipe_ckpt"
CORE_MODULES = (
    "ds_pipe_ckpt.planning.problem",
    "ds_pipe_ckpt.planning.plan",
    "ds_pipe_ckpt.planning.cost_model",
    "ds_pipe_ckpt.planning.solver",
    "ds_pipe_ckpt.planning.search_bounds",
    "ds_pipe_ckpt.planning.minimum_budget",
    "ds_pipe_ckpt.planning.kept_graph_solver",
    "ds_pipe_ckpt.planning.length_plans",
    "ds_pipe_ckpt.planning.partition",
    "ds_pipe_ckpt.planning.planned",
    "ds_pipe_ckpt.planning.stage_phase",
    "ds_pipe_ckpt.planning.stage_problem",
)
FORBIDDEN = ("torch", "deepspeed")


def _source_of(module):
    path = PACKAGE_ROOT.parent.joinpath(*module.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"


def _imports_of(module):
    tree = ast.parse(_source_of(module).read_text())
    package = module.rsplit(".", 1)[0] if not _source_of(module).name == "__init__.py" else module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                yield ".".join(base + ([node.module] if node.module else []))
            else:
                yield node.module


def forbidden_imports(module):
    """(importer, imported) pairs reaching torch or DeepSpeed from ``module``, following package imports."""
    found, seen, todo = [], set(), [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for name in _imports_of(current):
            if name.split(".")[0] in FORBIDDEN:
                found.append((current, name))
            elif name.startswith("ds_pipe_ckpt") and _source_of(name).exists():
                todo.append(name)
    return found


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_imports_no_torch(module):
    assert forbidden_imports(module) == []


def test_check_catches_a_torch_import():
    assert ("ds_pipe_ckpt.planning.stage", "torch") in forbidden_imports("ds_pipe_ckpt.planning.stage")
