"""What each guarantee of ``ds_pipe_ckpt.checkpoint`` costs per call: the
non-reentrant path with its parts switched off one after another, for
measurement only (:mod:`benchmarks.checkpointing.region_loop` ``--ablations``).

Each step down the ladder keeps what the one before kept, less one thing:

* ``ours``: everything (the default).
* ``ours_check_off``: ``determinism_check="none"`` (a supported option): no
  recompute check, so no Python call per saved tensor in the forward or the
  recomputation; torch's own count check stays, renamed to name the region.
* ``ours_no_renaming``: also no saved-tensor hooks in the forward at all: an
  input modified in place after the forward, or torch's count check, then
  surfaces as torch's own error without the region's name. Patched: not a
  supported configuration.
* ``ours_bare_call``: also nothing around the region's function: no
  model-parallel RNG tracker replay, no module-buffer handling, no in-place
  input watch; what is left is the call path into torch's checkpoint
  (options, the region's lookup, the per-call object). Patched likewise.

The differences between neighbours are what each part costs; the last one
against torch's own checkpoint is the call path itself.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch.utils.checkpoint as torch_checkpoint

import ds_pipe_ckpt
from ds_pipe_ckpt.recompute import SavedTensorProbe
from ds_pipe_ckpt.region_call import RegionCall

__all__ = ["Ablation", "ABLATIONS", "TORCH", "OURS"]


@dataclass(frozen=True)
class Ablation:
    """A checkpoint function and what is switched off around its calls."""

    name: str
    checkpoint: Callable[..., Any]
    switched_off: Callable[[], ContextManager[None]] = contextlib.nullcontext


@contextlib.contextmanager
def _patched(*replacements: tuple[type, str, Any]) -> Iterator[None]:
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in replacements]
    try:
        for owner, name, value in replacements:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _run_plainly(self: SavedTensorProbe, run: Callable[..., Any], args: tuple) -> Any:
    return run(*args)


def _call_function(self: RegionCall, *args: Any) -> Any:
    return self.fn(*args)


_no_renaming = functools.partial(_patched, (SavedTensorProbe, "run_forward", _run_plainly))
_bare_call = functools.partial(_patched, (RegionCall, "__call__", _call_function))

TORCH = Ablation("torch", functools.partial(torch_checkpoint.checkpoint, use_reentrant=False))
OURS = Ablation("ours", functools.partial(ds_pipe_ckpt.checkpoint, use_reentrant=False))
_CHECK_OFF = functools.partial(ds_pipe_ckpt.checkpoint, use_reentrant=False, determinism_check="none")

ABLATIONS = (
    TORCH,
    OURS,
    Ablation("ours_check_off", _CHECK_OFF),
    Ablation("ours_no_renaming", _CHECK_OFF, _no_renaming),
    Ablation("ours_bare_call", _CHECK_OFF, _bare_call),
)
