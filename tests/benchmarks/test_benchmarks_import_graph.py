"""The rules the benchmarks' package docstrings state, read from their imports
(the walker of ``tests/unit/test_import_graph.py``): no circle; a subject
(``checkpointing``, ``pipeline``) never imports another, only
``benchmarks.common``; inside the pipeline benchmark, ``partition`` and
``lengths`` never import each other nor the runner, and the measurement they
share imports neither; every ``__init__.py`` imports nothing, so that a rank
started by ``run_ranks`` loads only the module of its function."""

from __future__ import annotations

from pathlib import Path

from unit.test_import_graph import circles, import_graph

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
GRAPH = import_graph(BENCHMARKS)
SUBJECTS = ("benchmarks.checkpointing", "benchmarks.pipeline")
PIPELINE_SUBJECTS = ("benchmarks.pipeline.partition", "benchmarks.pipeline.lengths")


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _imports_into(module: str, package: str) -> set[str]:
    return {target for target in GRAPH[module] if _within(target, package)}


def test_the_walk_sees_both_subjects():
    assert {"benchmarks.common", "benchmarks.checkpointing.runner", "benchmarks.pipeline.runner",
            "benchmarks.pipeline.partition.runner", "benchmarks.pipeline.lengths.rank"} <= set(GRAPH)


def test_the_benchmarks_have_no_import_circle():
    assert circles(GRAPH) == []


def test_no_subject_imports_another():
    crossings = {(module, target) for subject in SUBJECTS for other in SUBJECTS if other != subject
                 for module in GRAPH if _within(module, subject) for target in _imports_into(module, other)}
    assert crossings == set()
    assert GRAPH["benchmarks.common"] == set()


def test_partition_and_lengths_import_neither_each_other_nor_the_runner():
    for subject in PIPELINE_SUBJECTS:
        for module in (name for name in GRAPH if _within(name, subject)):
            others = [other for other in PIPELINE_SUBJECTS if other != subject] + ["benchmarks.pipeline.runner"]
            assert [target for other in others for target in _imports_into(module, other)] == [], module


def test_the_shared_pipeline_measurement_imports_no_subject_of_it():
    shared = [name for name in GRAPH if _within(name, "benchmarks.pipeline") and name != "benchmarks.pipeline.runner"
              and name != "benchmarks.pipeline.__main__"
              and not any(_within(name, subject) for subject in PIPELINE_SUBJECTS)]
    assert "benchmarks.pipeline.rank" in shared
    for module in shared:
        assert [target for subject in PIPELINE_SUBJECTS for target in _imports_into(module, subject)] == [], module


def test_every_package_init_imports_nothing():
    packages = sorted(".".join(path.relative_to(BENCHMARKS.parent).parent.parts)
                      for path in BENCHMARKS.rglob("__init__.py"))
    assert len(packages) >= 5
    assert {name: GRAPH[name] for name in packages if GRAPH[name]} == {}
