"""One training step's memory on a pipeline stage, tracked from the step's
start to its optimizer step, for the planner (:mod:`.stage`): which steps
it tracks and why (:class:`TrackedStep`), and the tracking itself.

It tracks and reports; it must not decide what a step's figures mean (the
planner does) nor when a step begins (the stage planner finds that).
"""

from __future__ import annotations

import enum
import gc
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import memory

__all__ = ["TrackedStep", "StepMemory"]


class TrackedStep(enum.Enum):
    FIRST = "first"  # the first step: what it keeps allocated, before any plan
    MEASURING = "measuring"  # the step whose first micro-batch the meters measure
    CHECK = "check"  # a planned step: its peak checks the plan's prediction


class StepMemory:
    """Tracks the peak memory of one step of kind ``kind`` on ``device`` (by
    :mod:`ds_pipe_ckpt.memory`), from now until the next optimizer step, when
    ``on_end`` is called (or until :meth:`finish`, where no torch optimizer steps)."""

    def __init__(self, kind: TrackedStep, device: torch.device, on_end: Callable[[], None]):
        # Garbage made before the step (reference cycles, which the collector
        # frees at an arbitrary allocation) must not be freed inside the tracked
        # step: its size would lower the measured peak. A few steps only.
        gc.collect()
        self.kind = kind
        self._context = memory.track_memory(device)
        self.tracker = self._context.__enter__()
        # The step ends with the optimizer step (DeepSpeed's last instruction).
        self._hook = register_optimizer_step_post_hook(lambda *_: on_end())

    def marked(self, name: str) -> bool:
        return name in self.tracker.mark_names

    def mark_once(self, name: str) -> None:
        if not self.marked(name):
            self.tracker.mark(name)

    def finish(self) -> Any:
        """Stops tracking; the step's :class:`~ds_pipe_ckpt.memory.MemoryReport`."""
        self._hook.remove()
        self._context.__exit__(None, None, None)
        return self.tracker.report
