"""What the examples' training scripts share: the accelerator's default, the
command-line arguments a DeepSpeed launch passes, their checks, and saving a
rank's parameters. Imports no DeepSpeed (see :func:`default_to_cpu`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

__all__ = ["add_launch_arguments", "check_launch_arguments", "default_to_cpu", "save_parameters"]


def default_to_cpu() -> None:
    """``DS_ACCELERATOR=cpu`` (unless set already) when torch sees no GPU; call
    it before DeepSpeed is first imported (DeepSpeed then picks gloo)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def add_launch_arguments(parser: argparse.ArgumentParser, *, steps: int, out_dir: str) -> None:
    """``--deepspeed_config`` (one or more), ``--local_rank`` (set by the deepspeed
    launcher), ``--pp``, ``--steps``, ``--seed``, ``--dropout-seed``, ``--out-dir``,
    ``--save-params`` and ``--no-progress``."""
    parser.add_argument("--deepspeed_config", nargs="+", required=True, metavar="JSON",
                        help="DeepSpeed config(s); several are trained one after the other")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                        help="set by the deepspeed launcher")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps per config")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    parser.add_argument("--dropout-seed", type=int, default=None, help="seed of the dropout masks; default --seed")
    parser.add_argument("--out-dir", default=out_dir, help="where rank 0 writes its outputs")
    parser.add_argument("--save-params", action="store_true",
                        help="every rank saves its final state_dict (parameters and buffers) to "
                        "OUT_DIR/params/RUN/rank{R}.pt")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_launch_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Positive ``--pp``, ``--mp`` and ``--steps``; configs with distinct file
    names (each run is named after its file). Exits through ``parser.error``."""
    for name in ("pp", "mp", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    names = [Path(path).stem for path in args.deepspeed_config]
    if len(set(names)) != len(names):
        parser.error(f"the --deepspeed_config file names must differ (runs are named after them): {names}")


def save_parameters(module: torch.nn.Module, out_dir: str, run_name: str, rank: int) -> None:
    """This rank's ``state_dict`` (its stage's parameters and buffers, e.g.
    BatchNorm's running statistics), to ``OUT_DIR/params/RUN/rank{R}.pt``."""
    folder = Path(out_dir) / "params" / run_name
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({name: tensor.detach().clone() for name, tensor in module.state_dict().items()},
               folder / f"rank{rank}.pt")
