"""Model-parallel RNG for recomputation.

torch's checkpoint restores the CPU and device generators before it recomputes
a region. DeepSpeed's model-parallel tracker
(``deepspeed.checkpointing.get_cuda_rng_tracker()``) keeps further generator
states that ``tracker.fork()`` swaps in, e.g. for dropout inside a
tensor-parallel region; those must be replayed too, or the recomputed dropout
masks differ from the forward's.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["TrackerStates"]


class TrackerStates:
    """The tracker's generator states when a region's forward started."""

    def __init__(self, tracker: Any):
        self.tracker = tracker
        # get_states() copies the dict; fork() replaces entries, never mutates them.
        self.states = tracker.get_states()

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Run a recomputation with the forward's states; leave the tracker as it was."""
        live = self.tracker.get_states()
        self.tracker.set_states(dict(self.states))
        try:
            yield
        finally:
            self.tracker.set_states(live)
