"""Whether the wheels in ``.whl/`` complete the GPU machine's Python for DeepSpeed.

The GPU machine has no network and no DeepSpeed; what it lacks travels as
wheels (``tests/gpu/prepare_wheels.sh`` fills ``.whl/``) and is installed there
with ``pip install --no-index --no-deps``, which checks nothing. Two checks
stand in for pip's resolver:

* here, before the call (``python tests/gpu/wheels.py .whl``): every
  requirement reachable from ``deepspeed==0.19.8`` through the carried wheels'
  ``Requires-Dist`` (markers evaluated for CPython 3.12 on x86-64 Linux, extras
  left out) is met by a carried wheel of a matching version, or else by a
  package of the machine's image (:data:`MACHINE_PACKAGES`; where its version
  is not known, the requirement is listed as assumed); each carried wheel
  installs on that Python (its tags), and no name is carried twice (two
  versions stop the whole install);
* there, after the install (``python3 tests/gpu/wheels.py --installed``): the
  same walk over the distributions that interpreter imports, with their real
  versions.

Needs only the standard library and ``packaging`` (on both machines).
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

__all__ = ["ROOT", "MACHINE_PACKAGES", "TARGET", "Wheel", "Report", "read_wheel", "installs_on_target", "check_folder",
           "check_installed", "main"]

ROOT = "deepspeed==0.19.8"

# The packages of the GPU machine's image (python3 is /opt/torch/.venv, Python
# 3.12.3), as that image was read on 2026-11-17, with the versions a session's
# pip list showed there; None: present, version not known.
MACHINE_PACKAGES: dict[str, str | None] = {
    **dict.fromkeys(
        "absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build "
        "certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core "
        "cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython einops filelock fonttools fsspec h5py hf-xet "
        "httpcore httpx huggingface-hub hypothesis idna jinja2 joblib kiwisolver lightning markdown markupsafe "
        "matplotlib ml-dtypes mpi4py mpmath msgpack networkx ninja numba nvidia-ml-py opt-einsum packaging pandas "
        "peft pillow pip pluggy protobuf psutil py-cpuinfo pybind11 pygments pyparsing pytest pytest-timeout "
        "python-dateutil pyyaml regex requests rich safetensors scipy setuptools six sympy tabulate tokenizers "
        "torchvision tqdm transformers triton typing-extensions urllib3 wheel zipp".split()),
    "torch": "2.11.0",
    "numpy": "2.5.2",
}

# Marker environment of the GPU machine's interpreter.
TARGET = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_system": "Linux",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
}
# Wheel tags that interpreter installs (Ubuntu 24.04's glibc 2.39 takes any manylinux up to it).
_PYTHON_TAGS = {"py3", "py312", "cp312"}
_ABI_TAGS = {"none", "abi3", "cp312"}
_MANYLINUX = re.compile(r"manylinux(?:1|2010|2014|_2_(\d+))_x86_64")
_GLIBC_MINOR = 39


@dataclass(frozen=True)
class Wheel:
    """A wheel file: its distribution name (canonical), version, tags and requirements."""

    path: Path
    name: str
    version: Version
    tags: frozenset[tuple[str, str, str]]
    requires: tuple[Requirement, ...]


@dataclass
class Report:
    """What a check found: ``problems`` (the set is incomplete or will not
    install), ``assumed`` (requirements met by a machine package whose version
    is not known), ``met`` (name -> where from), ``unused`` (carried, needed by nothing)."""

    problems: list[str] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)
    met: dict[str, str] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.problems

    def text(self) -> str:
        lines = [f"{name}: {source}" for name, source in sorted(self.met.items())]
        lines += [f"assumed (machine version not known): {item}" for item in self.assumed]
        lines += [f"carried but needed by nothing: {name}" for name in self.unused]
        lines += [f"PROBLEM: {problem}" for problem in self.problems]
        lines.append("complete" if self.complete else f"INCOMPLETE: {len(self.problems)} problem(s)")
        return "\n".join(lines)


def read_wheel(path: Path) -> Wheel:
    """Name, version and tags from the file name (PEP 427), requirements from its METADATA.

    Raises:
        ValueError: the name is no wheel name, or the archive has no METADATA.
    """
    parts = path.name[:-len(".whl")].split("-") if path.name.endswith(".whl") else []
    if len(parts) not in (5, 6):
        raise ValueError(f"{path.name}: not a wheel file name (name-version[-build]-python-abi-platform.whl)")
    name, version, (pythons, abis, platforms) = parts[0], parts[1], parts[-3:]
    tags = frozenset((p, a, s) for p in pythons.split(".") for a in abis.split(".") for s in platforms.split("."))
    with zipfile.ZipFile(path) as archive:
        metadata = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(metadata) != 1:
            raise ValueError(f"{path.name}: expected one *.dist-info/METADATA, found {len(metadata)}")
        message = email.parser.Parser().parsestr(archive.read(metadata[0]).decode("utf-8"))
    requires = tuple(Requirement(line) for line in message.get_all("Requires-Dist") or ())
    return Wheel(path, canonicalize_name(name), Version(version), tags, requires)


def installs_on_target(wheel: Wheel) -> bool:
    """Whether one of the wheel's tags installs on CPython 3.12, x86-64 Linux."""
    for python, abi, platform in wheel.tags:
        if python not in _PYTHON_TAGS and not (abi == "abi3" and re.fullmatch(r"cp3(\d+)", python)
                                               and int(python[3:]) <= 12):
            continue
        if abi not in _ABI_TAGS:
            continue
        match = _MANYLINUX.fullmatch(platform)
        # manylinux1, 2010 and 2014 (no group) need glibc 2.5, 2.12 and 2.17: all installable there
        if platform == "any" or (match and int(match.group(1) or 0) <= _GLIBC_MINOR):
            return True
    return False


def _applies(requirement: Requirement) -> bool:
    """Whether the requirement applies on the target, without extras."""
    return requirement.marker is None or requirement.marker.evaluate({**TARGET, "extra": ""})


# A source of distributions: canonical name -> (version or None, its requirements
# or None when they are not followed, where it comes from), or None if absent.
Source = Callable[[str], "tuple[Version | None, tuple[Requirement, ...] | None, str] | None"]


def _walk(root: Requirement, source: Source, report: Report) -> set[str]:
    """Follow requirements from ``root`` through ``source``; returns the names reached."""
    queue = [(root, "the check")]
    seen: set[str] = set()
    while queue:
        requirement, needed_by = queue.pop(0)
        if not _applies(requirement):
            continue
        name = canonicalize_name(requirement.name)
        found = source(name)
        wanted = f"{requirement} (needed by {needed_by})"
        if found is None:
            report.problems.append(f"{wanted}: neither carried nor on the machine")
            continue
        version, requires, origin = found
        if version is None:
            if str(requirement.specifier):
                report.assumed.append(f"{wanted}: {origin}")
        elif not requirement.specifier.contains(version, prereleases=True):
            report.problems.append(f"{wanted}: {origin} has {version}")
        if name in seen:
            continue
        seen.add(name)
        report.met[name] = origin if version is None else f"{version}, {origin}"
        queue.extend((r, f"{name} {version}") for r in requires or ())
    return seen


def check_folder(folder: Path, machine: dict[str, str | None] | None = None, root: str = ROOT) -> Report:
    """Check the wheels in ``folder`` against the machine's packages (see the module docstring)."""
    machine = MACHINE_PACKAGES if machine is None else machine
    report = Report()
    wheels: dict[str, Wheel] = {}
    for path in sorted(Path(folder).glob("*.whl")):
        try:
            wheel = read_wheel(path)
        except (ValueError, zipfile.BadZipFile) as error:
            report.problems.append(str(error))
            continue
        if wheel.name in wheels:
            report.problems.append(f"{wheel.name} carried twice ({wheels[wheel.name].path.name}, {path.name}): "
                                   "pip stops on two versions of one name")
            continue
        wheels[wheel.name] = wheel
        if not installs_on_target(wheel):
            report.problems.append(f"{path.name} does not install on CPython 3.12, x86-64 Linux (its tags)")
    machine = {canonicalize_name(name): version for name, version in machine.items()}

    def source(name: str):
        if name in wheels:  # first on PYTHONPATH there, so it wins over the image's
            return wheels[name].version, wheels[name].requires, f"carried ({wheels[name].path.name})"
        if name in machine:
            version = machine[name]
            return (None if version is None else Version(version)), None, "the machine's image"
        return None

    reached = _walk(Requirement(root), source, report)
    report.unused = sorted(set(wheels) - reached)
    return report


def check_installed(root: str = ROOT) -> Report:
    """The same walk over the distributions this interpreter imports (``sys.path`` order)."""
    report = Report()

    def source(name: str):
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            return None
        requires = tuple(Requirement(line) for line in distribution.requires or ())
        location = getattr(distribution, "_path", None)
        return Version(distribution.version), requires, f"installed ({location.parent if location else '?'})"

    _walk(Requirement(root), source, report)
    return report


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/gpu/wheels.py", description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("folder", nargs="?", type=Path, help="the wheel folder to check against the machine's image")
    group.add_argument("--installed", action="store_true", help="check what this interpreter imports")
    args = parser.parse_args(None if argv is None else list(argv))
    if args.installed:
        report = check_installed()
    else:
        if not args.folder.is_dir():
            print(f"{args.folder}: no such folder; run tests/gpu/prepare_wheels.sh", file=sys.stderr)
            return 2
        report = check_folder(args.folder)
        total = sum(p.stat().st_size for p in args.folder.glob("*.whl"))
        print(f"{len(list(args.folder.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB in {args.folder}")
    print(report.text())
    return 0 if report.complete else 1


if __name__ == "__main__":
    sys.exit(main())
