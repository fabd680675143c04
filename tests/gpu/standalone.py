"""Import ds_pipe_ckpt's kernel modules without DeepSpeed.

``ds_pipe_ckpt/__init__.py`` imports DeepSpeed; the kernel modules
(``placement.pack``, ``.kernels``, ``.op_builder``, ``.pool``, ``.stash``) need only
torch. Where DeepSpeed is not installed (the GPU machine), the package is
registered as a bare namespace over its directory so that those submodules
import without running ``__init__``.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def import_modules(*names: str):
    """Return the named ``ds_pipe_ckpt`` submodules, in order."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        importlib.import_module("ds_pipe_ckpt")
    except ImportError:  # DeepSpeed (or another dependency of the full package) is missing
        for name in [n for n in sys.modules if n == "ds_pipe_ckpt" or n.startswith("ds_pipe_ckpt.")]:
            del sys.modules[name]
        package = types.ModuleType("ds_pipe_ckpt")
        package.__path__ = [str(ROOT / "ds_pipe_ckpt")]
        package.__file__ = str(ROOT / "ds_pipe_ckpt" / "__init__.py")
        sys.modules["ds_pipe_ckpt"] = package
    return tuple(importlib.import_module(f"ds_pipe_ckpt.{name}") for name in names)
