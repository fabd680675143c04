"""What ``tests/gpu/run.sh`` needs, checked without a GPU: the scripts parse,
the wheel set's completeness check decides right (on fake wheel folders, and on
``.whl/`` when ``tests/gpu/prepare_wheels.sh`` has filled it), and the engine
checks run end to end on CPU (``DS_PIPE_CKPT_GPU_TESTS_ON_CPU=1``: gloo, a tiny
model) with every check passing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


GPU = ROOT / "tests" / "gpu"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


wheels = _load("wheels")


@pytest.mark.parametrize("script", ["run.sh", "prepare_wheels.sh"])
def test_the_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _wheel(folder: Path, filename: str, *requires: str) -> Path:
    """A wheel file with only the METADATA the check reads."""
    name, version = filename.split("-")[:2]
    path = folder / filename
    with zipfile.ZipFile(path, "w") as archive:
        metadata = "".join(f"Requires-Dist: {r}\n" for r in requires)
        archive.writestr(f"{name}-{version}.dist-info/METADATA",
                         f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{metadata}")
    return path


MACHINE = {"torch": "2.11.0", "numpy": None, "packaging": None}


def _complete_folder(folder: Path) -> None:
    _wheel(folder, "deepspeed-0.19.8-py3-none-any.whl", "torch>=2.0.0", "numpy", "packaging>=20.0", "pydantic>=2.0.0",
           "hjson", 'pytest<8.4.0,>=7.2.0; extra == "dev"', 'tomli; python_version < "3.11"')
    _wheel(folder, "pydantic-2.14.4-py3-none-any.whl", "pydantic-core==2.50.5")
    _wheel(folder, "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")
    _wheel(folder, "hjson-3.1.0-py3-none-any.whl")


def test_a_complete_set_is_complete_and_lists_what_it_assumes(tmp_path):
    _complete_folder(tmp_path)
    report = wheels.check_folder(tmp_path, MACHINE)
    assert report.complete, report.text()
    assert report.met["pydantic-core"].startswith("2.50.5, carried")
    assert report.met["torch"] == "2.11.0, the machine's image"
    assert [a.split(" ")[0] for a in report.assumed] == ["packaging>=20.0"]  # present there, version not known
    assert "pytest" not in report.met and "tomli" not in report.met  # an extra, a marker false on 3.12
    assert report.unused == []


@pytest.mark.parametrize("change, problem", [
    (lambda f: (f / "hjson-3.1.0-py3-none-any.whl").unlink(), "hjson (needed by deepspeed 0.19.8): neither carried"),
    (lambda f: _wheel(f, "hjson-3.0.0-py3-none-any.whl"), "hjson carried twice"),
    (lambda f: (f / "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl").rename(
        f / "pydantic_core-2.50.5-cp311-cp311-manylinux_2_17_x86_64.whl"), "does not install on CPython 3.12"),
    (lambda f: _wheel(f, "pydantic-2.14.4-py3-none-any.whl", "pydantic-core==2.50.6"),
     "pydantic-core==2.50.6 (needed by pydantic 2.14.4): carried"),
    (lambda f: _wheel(f, "hjson-3.1.0-py3-none-any.whl", "torch>=2.12"), "torch>=2.12 (needed by hjson 3.1.0): "
     "the machine's image has 2.11.0"),
    (lambda f: (f / "broken.whl").write_text(""), "broken.whl: not a wheel file name"),
], ids=["missing", "two_versions", "wrong_python", "version_mismatch", "machine_too_old", "not_a_wheel"])
def test_an_incomplete_set_names_its_problem(tmp_path, change, problem):
    _complete_folder(tmp_path)
    change(tmp_path)
    report = wheels.check_folder(tmp_path, MACHINE)
    assert not report.complete
    assert any(problem in p for p in report.problems), report.problems


def test_a_wheel_nothing_needs_is_reported_not_refused(tmp_path):
    _complete_folder(tmp_path)
    _wheel(tmp_path, "six-1.17.0-py2.py3-none-any.whl")
    report = wheels.check_folder(tmp_path, MACHINE)
    assert report.complete and report.unused == ["six"]


def test_the_prepared_wheel_set_is_complete_for_the_gpu_machine():
    folder = ROOT / ".whl"
    if not folder.is_dir():
        pytest.skip(".whl/ has not been prepared (bash tests/gpu/prepare_wheels.sh fills it, with network access)")
    report = wheels.check_folder(folder)
    assert report.complete, report.text()
    assert sum(p.stat().st_size for p in folder.glob("*.whl")) < 40 * 2**20  # the call carries at most 64 MiB
