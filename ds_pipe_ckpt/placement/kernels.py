"""Pack and unpack of checkpoint activations: the compiled ops where they can
run, the pure-torch fallback (identical bytes) everywhere else.

* :func:`pack`: K tensors -> one rank's contiguous shard of their packed bytes.
* :func:`unpack`: the gathered buffer -> K tensors.

Layout and contracts: :mod:`ds_pipe_ckpt.placement.pack`. CUDA tensors use
``torch.ops.ds_pipe_ckpt.{pack,unpack}`` (one kernel launch each) when the ops
library is available; CPU tensors always use the fallback (a copy per tensor,
which on CPU is what the op's CPU implementation does anyway; that
implementation exists so that GPU-less CI checks the ops' planning logic
against the fallback).

Where the library comes from, first match wins, resolved once per process on
the first CUDA tensor (or by :func:`status`) and logged once:

1. ``DS_PIPE_CKPT_OPS=off``, a CPU-only torch, or no visible CUDA device: none;
   the fallback.
2. Built at install time (``DS_PIPE_CKPT_BUILD_OPS=1 pip install --no-build-isolation .``):
   ``ds_pipe_ckpt/placement/_ops*.so``.
3. A cached just-in-time build for the current sources and torch (see
   :mod:`ds_pipe_ckpt.placement.op_builder`).
4. A just-in-time build (needs nvcc and a host C++ compiler; about 20 s on 2 cores).

Otherwise the fallback, with the reason in :func:`status`. With
``DS_PIPE_CKPT_OPS=require`` an unavailable library raises instead.

Imports only torch (no DeepSpeed).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from . import op_builder
from .pack import pack_fallback, unpack_fallback

logger = logging.getLogger("ds_pipe_ckpt")

__all__ = ["KernelStatus", "ENV_MODE", "status", "pack", "unpack", "load_library", "installed_library",
           "ops_registered"]

ENV_MODE = "DS_PIPE_CKPT_OPS"
COMPILED = "compiled"
FALLBACK = "fallback"
_MODES = ("auto", "off", "require")


@dataclass(frozen=True)
class KernelStatus:
    """Which implementation packs and unpacks CUDA tensors, and why."""

    path: str  # "compiled" or "fallback"
    reason: str
    library: str | None = None

    @property
    def compiled(self) -> bool:
        return self.path == COMPILED

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


def ops_registered() -> bool:
    """True when ``torch.ops.ds_pipe_ckpt.pack`` and ``unpack`` exist in this process."""
    return all(torch._C._dispatch_has_kernel(f"ds_pipe_ckpt::{name}") for name in ("pack", "unpack"))


def load_library(path: str | os.PathLike) -> None:
    """Load an ops library (idempotent)."""
    if not ops_registered():
        torch.ops.load_library(str(path))


def installed_library() -> Path | None:
    """The library built at install time (``DS_PIPE_CKPT_BUILD_OPS=1``), if any."""
    matches = sorted(Path(__file__).resolve().parent.glob("_ops*.so"))
    return matches[0] if matches else None


def _mode() -> str:
    mode = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{ENV_MODE}={mode!r} is invalid: expected one of {list(_MODES)}")
    return mode


def _resolve() -> KernelStatus:
    if _mode() == "off":
        return KernelStatus(FALLBACK, f"{ENV_MODE}=off")
    if torch.version.cuda is None:
        return KernelStatus(FALLBACK, "torch is a CPU-only build")
    if not torch.cuda.is_available():
        return KernelStatus(FALLBACK, "no CUDA device is visible")
    for origin, library in (("built at install time", installed_library()),
                            ("cached just-in-time build", op_builder.cached_library())):
        if library is None:
            continue
        try:
            load_library(library)
        except (OSError, RuntimeError) as error:
            logger.warning("ds_pipe_ckpt: could not load %s (%s): %s", library, origin, error)
            continue
        return KernelStatus(COMPILED, origin, str(library))
    try:
        library = op_builder.build()
        load_library(library)
    except (op_builder.BuildError, OSError, RuntimeError) as error:
        logger.warning("ds_pipe_ckpt: could not build the pack/unpack ops, using the torch fallback: %s", error)
        return KernelStatus(FALLBACK, f"just-in-time build failed: {error}")
    return KernelStatus(COMPILED, "just-in-time build", str(library))


class _Resolution:
    """The process-wide answer of :func:`_resolve` (an ops library, once loaded,
    stays registered for the life of the process)."""

    lock = threading.Lock()
    status: KernelStatus | None = None


def status() -> KernelStatus:
    """Resolve (building if needed, see the module docstring) and report which
    implementation CUDA tensors use. Logged once per process."""
    if _Resolution.status is None:
        with _Resolution.lock:
            if _Resolution.status is None:
                resolved = _resolve()
                logger.info("ds_pipe_ckpt: pack/unpack of checkpoint inputs on CUDA: %s", resolved)
                _Resolution.status = resolved
    if _Resolution.status.path == FALLBACK and _mode() == "require":
        raise RuntimeError(f"{ENV_MODE}=require but the pack/unpack ops are unavailable: "
                           f"{_Resolution.status.reason}")
    return _Resolution.status


def _use_ops(device: torch.device) -> bool:
    return device.type == "cuda" and status().compiled


def pack(tensors: Sequence[torch.Tensor], offsets: Sequence[int], begin: int, out: torch.Tensor) -> None:
    """Write bytes ``[begin, begin + out.numel())`` of the packed layout of
    ``tensors`` (contiguous, at byte ``offsets``) into the uint8 tensor ``out``;
    uncovered bytes become zeros."""
    if _use_ops(out.device):
        torch.ops.ds_pipe_ckpt.pack(list(tensors), list(offsets), begin, out)
    else:
        pack_fallback(tensors, offsets, begin, out)


def unpack(buffer: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    """Copy each ``outs[i]``'s bytes from ``buffer[offsets[i]:]``."""
    if _use_ops(buffer.device):
        torch.ops.ds_pipe_ckpt.unpack(buffer, list(offsets), list(outs))
    else:
        unpack_fallback(buffer, offsets, outs)
