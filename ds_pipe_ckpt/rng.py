"""Model-parallel RNG for recomputation.

torch's checkpoint restores the CPU and device generators before it recomputes
a region. DeepSpeed's model-parallel tracker
(``deepspeed.checkpointing.get_cuda_rng_tracker()``) keeps further generator
states that ``tracker.fork()`` swaps in, e.g. for dropout inside a
tensor-parallel region; those must be replayed too, or the recomputed dropout
masks differ from the forward's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

__all__ = ["ReplayTrackerStates"]


class ReplayTrackerStates:
    """Wrap ``fn`` so that every call after the first runs with the tracker
    states the first call saw, and leaves the tracker as it found it.

    The first call is the original forward; later calls are recomputations.
    """

    def __init__(self, fn: Callable[..., Any], tracker: Any):
        self.fn = fn
        self.tracker = tracker
        self.forward_states = None
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.forward_states is None:
            # get_states() copies the dict; fork() replaces entries, never mutates them.
            self.forward_states = self.tracker.get_states()
            return self.fn(*args, **kwargs)
        live_states = self.tracker.get_states()
        self.tracker.set_states(dict(self.forward_states))
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.tracker.set_states(live_states)
