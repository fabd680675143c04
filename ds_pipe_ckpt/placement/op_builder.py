"""Build ``csrc/`` into a shared library of torch ops (``ds_pipe_ckpt::pack``,
``ds_pipe_ckpt::unpack``), cached by content.

The ops are registered with ``TORCH_LIBRARY`` and loaded with
``torch.ops.load_library``, so the library needs neither pybind11 nor Python
headers, and this builder needs neither ninja nor setuptools: it runs ``nvcc``
on the CUDA file (which includes no torch header and compiles in seconds) and
the host compiler on the C++ file (light torch headers only), in parallel, then
links. Measured on a 2-core machine: about 20 s, against about 3 minutes for one
file that includes ``<torch/extension.h>``.

Builds are cached under ``$DS_PIPE_CKPT_OPS_CACHE`` (default
``~/.cache/ds_pipe_ckpt/ops``) in a directory named by a hash of the sources,
the torch and CUDA versions, the C++ ABI and the target architectures: a
changed source rebuilds once, anything else loads the cached library. Ranks
that build concurrently serialise on a file lock and the later ones load the
first one's result.

This module imports only torch and the standard library (no DeepSpeed).

Environment:
    ``DS_PIPE_CKPT_OPS_CACHE``: cache directory.
    ``MAX_JOBS``: compiler processes to run at once (default: 2, at most the CPU count).
    ``TORCH_CUDA_ARCH_LIST``: target architectures, torch's format (``"8.0;9.0+PTX"``);
        default: the visible GPUs', or else those torch itself was built for.
    ``CUDA_HOME``/``CUDA_PATH``: the CUDA toolkit (default: found from ``nvcc`` on PATH).
    ``CXX``: the host C++ compiler (default: ``c++`` or ``g++`` from PATH).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from ..compat import compiled_cuda_archs

logger = logging.getLogger("ds_pipe_ckpt")

__all__ = ["BuildError", "LIBRARY_NAME", "SOURCES", "build", "build_key", "cached_library",
           "cuda_home", "host_compiler", "source_dir", "cache_root"]

LIBRARY_NAME = "libds_pipe_ckpt_ops.so"
SOURCES = ("ops.cpp", "batched_copy.cu", "batched_copy.h")
_BUILDER_VERSION = "1"  # bump when the commands below change


class BuildError(RuntimeError):
    """The ops could not be built; the message says which step failed and why."""


def source_dir() -> Path | None:
    """The ``csrc/`` directory of this source checkout, or None (e.g. in a wheel install)."""
    candidate = Path(__file__).resolve().parents[2] / "csrc"
    return candidate if all((candidate / name).is_file() for name in SOURCES) else None


def cuda_home() -> Path | None:
    """The CUDA toolkit root (has ``bin/nvcc`` and ``include/cuda_runtime.h``), or None."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    for candidate in candidates:
        if candidate and (Path(candidate) / "bin" / "nvcc").is_file() and \
                (Path(candidate) / "include" / "cuda_runtime.h").is_file():
            return Path(candidate)
    return None


def cache_root() -> Path:
    root = os.environ.get("DS_PIPE_CKPT_OPS_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ds_pipe_ckpt" / "ops"


def _arch_flags() -> list[str]:
    """nvcc ``-gencode`` flags: SASS for each target, plus PTX of the newest one
    (or of those marked ``+PTX`` in TORCH_CUDA_ARCH_LIST) for newer GPUs."""
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch_list:
        entries = arch_list.replace(",", ";").replace(" ", ";").split(";")
        archs = [(e.replace("+PTX", "").replace(".", ""), e.endswith("+PTX")) for e in entries if e]
    elif torch.cuda.is_available():
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        archs = [(f"{major}{minor}", False) for major, minor in caps]
    else:
        archs = [(a[3:], False) for a in compiled_cuda_archs() if a.startswith("sm_")]
    if not archs:
        raise BuildError("no CUDA architecture to build for: set TORCH_CUDA_ARCH_LIST (e.g. \"9.0\")")
    if not any(ptx for _, ptx in archs):
        archs[-1] = (archs[-1][0], True)
    flags = []
    for arch, ptx in archs:
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{arch},code=compute_{arch}")
    return flags


def host_compiler() -> str | None:
    """``$CXX``, else the first of ``c++`` and ``g++`` on PATH."""
    if os.environ.get("CXX"):
        return os.environ["CXX"]
    return shutil.which("c++") or shutil.which("g++")


def _commands(src: Path, out_dir: Path, cuda: Path, cxx: str) -> tuple[list[list[str]], list[str], Path]:
    torch_dir = Path(torch.__file__).resolve().parent
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    cu_obj, cpp_obj = out_dir / "batched_copy.o", out_dir / "ops.o"
    nvcc = [str(cuda / "bin" / "nvcc"), "-c", str(src / "batched_copy.cu"), "-o", str(cu_obj), "-O3",
            "-std=c++17", "-Xcompiler", "-fPIC", *_arch_flags()]
    if os.environ.get("CXX"):
        nvcc += ["-ccbin", cxx]
    host = [cxx, "-c", str(src / "ops.cpp"), "-o", str(cpp_obj), "-O2", "-std=c++20", "-fPIC", abi,
            "-DDS_PIPE_CKPT_WITH_CUDA", f"-I{torch_dir / 'include'}", f"-I{cuda / 'include'}"]
    library = out_dir / LIBRARY_NAME
    link = [cxx, "-shared", str(cpp_obj), str(cu_obj), "-o", str(library), f"-L{torch_dir / 'lib'}",
            "-lc10", "-ltorch_cpu", "-lc10_cuda", f"-L{cuda / 'lib64'}", "-lcudart"]
    return [nvcc, host], link, library


def build_key(src: Path | None = None) -> str:
    """Hash of everything the library depends on (see the module docstring)."""
    src = src or source_dir()
    if src is None:
        raise BuildError("the csrc/ sources are not available (this is not a source checkout); "
                         "install with DS_PIPE_CKPT_BUILD_OPS=1 to build the ops at install time")
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode())
        digest.update((src / name).read_bytes())
    for part in (_BUILDER_VERSION, torch.__version__, str(torch.version.cuda),
                 str(torch._C._GLIBCXX_USE_CXX11_ABI), " ".join(_arch_flags())):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def cached_library(src: Path | None = None) -> Path | None:
    """The cached build for the current sources and torch, if there is one."""
    try:
        path = cache_root() / build_key(src) / LIBRARY_NAME
    except BuildError:
        return None
    return path if path.is_file() else None


def _run_parallel(commands: list[list[str]], jobs: int, log: Path) -> None:
    pending = list(commands)
    running: list[tuple[list[str], subprocess.Popen]] = []
    with open(log, "ab") as log_file:
        while pending or running:
            while pending and len(running) < jobs:
                command = pending.pop(0)
                log_file.write(("$ " + " ".join(command) + "\n").encode())
                log_file.flush()
                running.append((command, subprocess.Popen(command, stdout=subprocess.PIPE,
                                                          stderr=subprocess.STDOUT)))
            command, process = running.pop(0)
            output, _ = process.communicate()
            log_file.write(output)
            if process.returncode != 0:
                for _, other in running:
                    other.kill()
                    other.wait()
                tail = output.decode(errors="replace")[-4000:]
                raise BuildError(f"`{Path(command[0]).name}` failed with exit code {process.returncode} "
                                 f"(full log: {log}):\n{tail}")


def build(src: Path | None = None, jobs: int | None = None) -> Path:
    """Build the ops library (or return the cached one) and return its path.

    Raises:
        BuildError: no sources, no CUDA toolkit, or a compiler error (with its output).
    """
    src = src or source_dir()
    key = build_key(src)
    target_dir = cache_root() / key
    library = target_dir / LIBRARY_NAME
    if library.is_file():
        return library
    cuda = cuda_home()
    if cuda is None:
        raise BuildError("no CUDA toolkit found (nvcc): set CUDA_HOME or put nvcc on PATH")
    cxx = host_compiler()
    if cxx is None:
        raise BuildError("no host C++ compiler found: set CXX or put c++/g++ on PATH")
    if jobs is None:
        jobs = int(os.environ.get("MAX_JOBS", "2"))
    jobs = max(1, min(jobs, os.cpu_count() or 1))
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(target_dir.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent builder finishes first; then use its result
        if library.is_file():
            return library
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=target_dir.parent, prefix=f"{key}.tmp") as tmp:
            tmp_dir = Path(tmp)
            compiles, link, built = _commands(src, tmp_dir, cuda, cxx)
            log = tmp_dir / "build.log"
            _run_parallel(compiles, jobs, log)
            _run_parallel([link], 1, log)
            target_dir.mkdir(exist_ok=True)
            shutil.copy2(log, target_dir / "build.log")
            os.replace(built, library)
        logger.info("ds_pipe_ckpt: built the pack/unpack ops in %.1f s into %s",
                    time.perf_counter() - started, library)
    return library
