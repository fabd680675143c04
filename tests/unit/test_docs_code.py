"""The code in README.md and docs/*.md compiles, and runs where it can, so that
examples cannot rot.

Every ```python block is compiled (a syntax error fails). The rule for which
blocks are also executed, in a fresh namespace with a temporary working
directory:

* a block is **executed** when it is self-contained: every name it reads is a
  builtin or bound in the block itself (imported, assigned, a function or an
  ``except ... as`` name), and it calls none of ``LAUNCHED`` (``initialize``,
  ``check_gradient_parity``, ``init_distributed``: they need one process per
  rank, started by a launcher);
* otherwise (it reads a name the reader supplies, such as ``model``,
  ``train_loader`` or ``Block``, or needs a launched job) it is **compiled
  only**.

Every ```json block that is JSON (a block with ``...`` in it abbreviates a
config and is skipped) must also be accepted by ds_pipe_ckpt's parsers, and
every relative link in README.md, CHANGELOG.md and docs/*.md must name a file
that exists and, with ``#anchor``, a heading of it (GitHub's anchors).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import json
import os
import re
from pathlib import Path

import pytest

from ds_pipe_ckpt.config import CheckpointingConfig
from ds_pipe_ckpt.planning.planned_partition import partition_from_config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED_PAGES = [*PAGES, ROOT / "CHANGELOG.md"]
LAUNCHED = {"initialize", "check_gradient_parity", "init_distributed"}


def blocks(language: str) -> list[tuple[str, str]]:
    """(``page:line``, source) of every fenced block of ``language``."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(rf"^```{language}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
            line = text.count("\n", 0, match.start()) + 2
            found.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
    return found


PYTHON = blocks("python")
JSON = blocks("json")


def free_names(tree: ast.AST) -> set[str]:
    """Names the code reads that are neither builtins nor bound anywhere in it."""
    loaded, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound - set(dir(builtins))


def called_launched(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            function = node.func
            name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
            if name in LAUNCHED:
                names.add(name)
    return names


def runnable(source: str, where: str = "<doc>") -> bool:
    """Compile ``source`` (SyntaxError on a bad block) and say whether the rule executes it."""
    compile(source, where, "exec")
    tree = ast.parse(source)
    return not free_names(tree) and not called_launched(tree)


def test_the_docs_have_python_blocks_and_some_run():
    assert len(PYTHON) >= 4
    assert any(runnable(source) for _, source in PYTHON), "no block is executed: the rule would check nothing"


def test_a_syntax_error_fails():
    with pytest.raises(SyntaxError):
        runnable("model = PipelineModule(layers=[\n")


def test_the_rule():
    assert runnable("import torch\nx = torch.ones(2)\nprint(x.sum())")
    assert not runnable("engine = initialize(model)")
    assert not runnable("import ds_pipe_ckpt\nds_pipe_ckpt.initialize(model=1)")
    assert not runnable("import transformers\nmodel.enable()")


@pytest.mark.parametrize("where, source", PYTHON, ids=[where for where, _ in PYTHON])
def test_python_block(where, source, tmp_path):
    if not runnable(source, where):
        return  # compiled above; it needs names the reader supplies, or a launched job
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(source, where, "exec"), {"__name__": "__docs__"})
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("where, source", JSON, ids=[where for where, _ in JSON])
def test_json_block(where, source):
    if "..." in source:
        return  # an abbreviated config
    config = json.loads(source)
    CheckpointingConfig.from_ds_config(config)
    partition_from_config(config)


def without_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped,
    spaces as hyphens, a repeated heading numbered."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", without_code(page.read_text()), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def links() -> list[tuple[str, str]]:
    found = []
    for page in LINKED_PAGES:
        if not page.exists():
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text())):
            if not re.match(r"[a-z]+:", target):  # not http:, https:, mailto:
                found.append((str(page.relative_to(ROOT)), target))
    return found


@pytest.mark.parametrize("page, target", links())
def test_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    file = (ROOT / page).parent / path if path else ROOT / page
    assert file.exists(), f"{page} links to {target}: no such file"
    if anchor and file.suffix == ".md":
        assert anchor in anchors(file), f"{page} links to {target}: no such heading in {file.name}"
