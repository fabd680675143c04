"""The compatibility run: the unit tests against each supported (DeepSpeed, torch) pair.

    make compat                                   # every pair of the stated range
    .venv/bin/python .ci/compat.py --pairs 0.18.9:2.14.1 0.19.8:2.11.0
    .venv/bin/python .ci/compat.py --list         # the pairs and the test subset, nothing run

For each pair it builds a virtual environment under ``.compat/`` with uv
(which links packages from its cache, so a second venv with the same torch
costs seconds, not another 5 GB copy), installs that torch, that DeepSpeed
(without its compiled ops: ``DS_BUILD_OPS=0``, as on a CPU), the test tools and
this checkout (editable, ``--no-deps``: the pair's own versions stay), runs the
subset below on the CPU (``DS_ACCELERATOR=cpu``, gloo), then the gradient-parity
check (``python -m ds_pipe_ckpt.parity_cli --pp 2 4 --ga 4``: each stage's update
against the same layers without a pipeline, every mode the pair runs), and
prints the matrix: one row per pair with passed / failed / errors / skipped,
the largest parity difference, each skip reason once, and the wall time. ``.compat/matrix.md`` and ``.compat/matrix.json``
keep it; each pair's log is ``.compat/<pair>.log``.

torch's wheels on PyPI are CUDA builds (about 3.5 GB with their CUDA
libraries, run here on the CPU); torch 2.13.0's CPU wheel is taken from the
local ``--find-links`` folders where the machine has one. CI does not run
this: it keeps the pinned pair of ``make test``.

Exit status: 0 when every pair passed (skips allowed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".compat"

# The stated range (README.md, setup.py): each DeepSpeed minor with the pinned
# torch, and each torch minor with the newest DeepSpeed. The corners (oldest
# DeepSpeed with the oldest torch) are covered by the same code paths: the
# two libraries' differences are independent of each other in ds_pipe_ckpt.compat.
PAIRS = [
    ("0.16.9", "2.14.1"),
    ("0.17.6", "2.14.1"),
    ("0.18.9", "2.14.1"),
    ("0.19.8", "2.11.0"),
    ("0.19.8", "2.12.1"),
    ("0.19.8", "2.13.0"),
    ("0.19.8", "2.14.1"),
    ("0.19.8", "2.15.0"),
    ("0.16.9", "2.11.0"),
]

# The in-process and multi-rank tiers, less what tests our own tooling rather
# than the package against a library version: the multi-rank harness's tests
# (one is a 60 s sleep) and the GPU script's CPU-side tests (shell and wheel
# bookkeeping). tests/benchmarks (whole benchmark runs) stays out. What stays
# runs in under 10 minutes per pair on 2 cores.
SUBSET = ["tests/unit", "tests/multirank"]
DESELECT = [
    "tests/multirank/test_rank_runner.py",
    "tests/multirank/test_gpu_engine_checks.py",
    "tests/unit/test_testing.py",
    "tests/unit/test_gpu_script.py",
]
TEST_TOOLS = ["numpy", "pytest>=8", "pytest-timeout", "hypothesis>=6", "transformers>=5,<6", "peft",
              "setuptools", "wheel"]
PAIR_TIMEOUT_S = 15 * 60
# The gradient-parity column (python -m ds_pipe_ckpt.parity_cli): the largest
# relative difference of any stage's update from the same layers without a
# pipeline; a pair above ds_pipe_ckpt.parity's tolerance fails.
PARITY_GA = 4
PARITY_TIMEOUT_S = 10 * 60


@dataclasses.dataclass
class Result:
    deepspeed: str
    torch: str
    installed: str = ""          # what the venv really holds, "torch X, deepspeed Y"
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    problem: str = ""            # an install or run failure that left no test report
    # python -m ds_pipe_ckpt.parity_cli: the largest relative difference of any stage
    # from the same layers without a pipeline, per "pp=P mode", and whether all are within tolerance
    parity: dict = dataclasses.field(default_factory=dict)
    parity_ok: bool = False
    failures: list[str] = dataclasses.field(default_factory=list)
    skip_reasons: list[str] = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        return f"deepspeed-{self.deepspeed}_torch-{self.torch}"

    @property
    def ok(self) -> bool:
        return not self.problem and not self.failed and not self.errors and self.passed > 0 and self.parity_ok


def _run(command: list[str], log, env: dict | None = None, timeout: float | None = None) -> int:
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    try:
        return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout,
                              cwd=ROOT).returncode
    except subprocess.TimeoutExpired:
        log.write(f"timed out after {timeout:.0f} s\n")
        return 124


def _uv() -> str:
    found = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(found).exists():
        raise SystemExit("uv is needed to build the compatibility venvs: pip install uv (make compat does)")
    return found


def _find_links() -> list[str]:
    """Local wheel folders pip is configured with (PIP_FIND_LINKS), e.g. a CPU torch on disk."""
    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    return [arg for folder in folders if Path(folder).is_dir() for arg in ("--find-links", folder)]


def build(result: Result, venv: Path, log) -> bool:
    """The pair's venv, built once; False (with ``result.problem``) when it cannot be."""
    python = venv / "bin" / "python"
    stamp = venv / ".ds_pipe_ckpt_compat"
    if stamp.exists():
        return True
    uv = _uv()
    env = dict(os.environ, VIRTUAL_ENV=str(venv), DS_BUILD_OPS="0", UV_HTTP_TIMEOUT="300")
    env.pop("PIP_CONSTRAINT", None)
    steps = [
        [uv, "venv", "-q", "--clear", "-p", sys.executable, str(venv)],
        # torch and the test tools first: DeepSpeed's setup.py imports torch.
        [uv, "pip", "install", "-q", *_find_links(), f"torch=={result.torch}", *TEST_TOOLS],
        [uv, "pip", "install", "-q", "--no-build-isolation", f"deepspeed=={result.deepspeed}"],
        [uv, "pip", "install", "-q", "--no-deps", "-e", str(ROOT)],
    ]
    for step in steps:
        if _run(step, log, env=env, timeout=1800) != 0:
            result.problem = f"install failed: {' '.join(step[1:4])} ... (see {log.name})"
            return False
    if _run([str(python), "-c", "import torch, deepspeed, ds_pipe_ckpt"], log,
            env=dict(os.environ, DS_ACCELERATOR="cpu")) != 0:
        result.problem = f"import failed (see {log.name})"
        return False
    stamp.touch()
    return True


def read_report(result: Result, report: Path) -> None:
    suites = ElementTree.parse(report).getroot()
    reasons: dict[str, int] = {}
    for case in suites.iter("testcase"):
        test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome = next(iter(case), None)
        if outcome is None:
            result.passed += 1
        elif outcome.tag == "skipped":
            result.skipped += 1
            reason = (outcome.get("message") or "").strip()
            reasons[reason] = reasons.get(reason, 0) + 1
        elif outcome.tag == "failure":
            result.failed += 1
            result.failures.append(f"{test}: {(outcome.get('message') or '').splitlines()[0][:200]}")
        elif outcome.tag == "error":
            result.errors += 1
            result.failures.append(f"{test} (error): {(outcome.get('message') or '').splitlines()[0][:200]}")
        else:  # system-out / system-err only
            result.passed += 1
    result.skip_reasons = [f"{count} x {reason}" for reason, count in sorted(reasons.items())]


def run_pair(result: Result, pytest_args: list[str], build_only: bool = False) -> Result:
    WORK.mkdir(exist_ok=True)
    venv = WORK / "venvs" / result.name
    log_path = WORK / f"{result.name}.log"
    started = time.perf_counter()
    with open(log_path, "w") as log:
        if build(result, venv, log) and not build_only:
            python = str(venv / "bin" / "python")
            probe = subprocess.run([python, "-c", "import torch, deepspeed; "
                                    "print(f'torch {torch.__version__}, deepspeed {deepspeed.__version__}')"],
                                   capture_output=True, text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"))
            result.installed = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else "?"
            report = WORK / f"{result.name}.xml"
            report.unlink(missing_ok=True)
            command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                       *SUBSET, *(f"--deselect={d}" for d in DESELECT if "::" in d),
                       *(f"--ignore={d}" for d in DESELECT if "::" not in d), *pytest_args]
            # DeepSpeed JIT-builds its CPU communication op on first use; a build
            # directory shared across torch versions deadlocks: torch 2.14 leaves
            # its (fcntl) lock file behind, which torch 2.11's FileBaton takes for a
            # build in progress and waits on forever. One directory per pair.
            env = dict(os.environ, DS_ACCELERATOR="cpu",
                       TORCH_EXTENSIONS_DIR=str(WORK / "torch_extensions" / result.name))
            code = _run(command, log, env=env, timeout=PAIR_TIMEOUT_S)
            if report.exists():
                read_report(result, report)
            if code not in (0, 1) or not report.exists():
                result.problem = result.problem or f"pytest exited with {code} (see {log_path.name})"
            run_parity(result, python, env, log)
    result.seconds = time.perf_counter() - started
    return result


def run_parity(result: Result, python: str, env: dict, log) -> None:
    """The gradient-parity column: pp 2 and 4 at GA 4, every mode the pair runs on a CPU."""
    out = WORK / f"{result.name}.parity.json"
    out.unlink(missing_ok=True)
    code = _run([python, "-m", "ds_pipe_ckpt.parity_cli", "--pp", "2", "4", "--ga", str(PARITY_GA),
                 "--json", str(out)], log, env=env, timeout=PARITY_TIMEOUT_S)
    if not out.exists():
        result.problem = result.problem or f"parity check exited with {code}, no result (see {log.name})"
        return
    for row in json.loads(out.read_text())["results"]:
        result.parity[f"pp={row['pp']} {row['mode']}"] = max(row["stages"])
    result.parity_ok = code == 0


def _parity_cell(result: Result) -> str:
    if not result.parity:
        return "-"
    worst = max(result.parity.values())
    return f"{worst:.2g} ({len(result.parity)} runs{'' if result.parity_ok else ', ABOVE tolerance'})"


def matrix(results: list[Result]) -> str:
    lines = ["| DeepSpeed | torch | installed | passed | failed | errors | skipped | "
             f"gradient parity (GA {PARITY_GA}, pp 2 and 4) | minutes | result |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---|"]
    for r in results:
        verdict = "pass" if r.ok else (r.problem or "FAIL")
        lines.append(f"| {r.deepspeed} | {r.torch} | {r.installed} | {r.passed} | {r.failed} | {r.errors} | "
                     f"{r.skipped} | {_parity_cell(r)} | {r.seconds / 60:.1f} | {verdict} |")
    details = []
    for r in results:
        if r.failures or r.skip_reasons:
            details.append(f"\n{r.deepspeed} / {r.torch}:")
            details += [f"- FAILED {f}" for f in r.failures[:20]]
            details += [f"- skipped {s}" for s in r.skip_reasons]
    return "\n".join(lines + details) + "\n"


def _pair(text: str) -> tuple[str, str]:
    deepspeed, sep, torch = text.partition(":")
    if not sep or not deepspeed or not torch:
        raise argparse.ArgumentTypeError(f"{text!r}: expected DEEPSPEED:TORCH, e.g. 0.18.9:2.14.1")
    return deepspeed, torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python .ci/compat.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", type=_pair, default=PAIRS, metavar="DEEPSPEED:TORCH")
    parser.add_argument("--list", action="store_true", help="print the pairs and the test subset, run nothing")
    parser.add_argument("--build-only", action="store_true", help="build the pairs' venvs, run no test")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, after --")
    args = parser.parse_args(argv)
    if args.list:
        print("pairs:", " ".join(f"{d}:{t}" for d, t in args.pairs))
        print("tests:", " ".join(SUBSET), " ".join(f"(without {d})" for d in DESELECT))
        return 0
    results = []
    for deepspeed, torch in args.pairs:
        print(f"== deepspeed {deepspeed}, torch {torch}", flush=True)
        result = run_pair(Result(deepspeed, torch), args.pytest_args, args.build_only)
        if args.build_only:
            print(f"   {result.problem or 'built'} in {result.seconds:.0f} s", flush=True)
            continue
        print(f"   {result.passed} passed, {result.failed} failed, {result.errors} errors, "
              f"{result.skipped} skipped in {result.seconds / 60:.1f} min{'' if result.ok else ': ' + (result.problem or 'FAILED')}",
              flush=True)
        results.append(result)
    if args.build_only:
        return 0
    table = matrix(results)
    print("\n" + table)
    (WORK / "matrix.md").write_text(table)
    (WORK / "matrix.json").write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
