"""Each configuration rule's error text is written in one file.

A rule checked in two places drifts: the two texts (and the two checks) part
ways. This scans every ``ConfigError(key, value, allowed, ...)`` call in
``ds_pipe_ckpt`` and fails when the same ``allowed`` template (its source text,
f-string placeholders included) is raised from two files; the rule belongs in
one function that both callers call (e.g.
``ds_pipe_ckpt.config.check_module_against_config``).
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "ds_pipe_ckpt"


def _templates(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                == "ConfigError" and len(node.args) >= 3):
            continue
        allowed = node.args[2]
        if isinstance(allowed, (ast.Constant, ast.JoinedStr)):
            yield ast.unparse(allowed), node.lineno


def test_each_config_error_template_lives_in_one_file():
    where = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        for template, line in _templates(path):
            where[template].add(f"{path.relative_to(PACKAGE.parent)}:{line}")
    twice = {t: sorted(places) for t, places in where.items()
             if len({p.rsplit(":", 1)[0] for p in places}) > 1}
    assert not twice, ("the same ConfigError text is raised from two files; move the rule into one function "
                       f"that both call: {twice}")


def test_the_scan_sees_the_module_rules():
    seen = {t for path in PACKAGE.rglob("*.py") for t, _ in _templates(path)}
    for fragment in ("0 when {key} is set", "null unless pipeline.use_reentrant is false",
                     "null unless the PipelineModule is built with dynamic_shape=True"):
        assert any(fragment in t for t in seen), fragment
