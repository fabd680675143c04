"""The function torch's checkpoint runs for one region.

torch calls it once for the forward and once per recomputation; it is the one
place that tells the two apart. Around the forward it records what the
recomputation must reproduce (DeepSpeed's model-parallel RNG states, the
tensors the region saves, with ``verify_recompute`` every op); around each
recomputation it replays and checks them, inside the region placement's
synchronisation and timing.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from .placement.runtime import RegionPlacement
from .recompute import OpTrace, SavedTensorProbe, renamed, require_tensor_output
from .regions import Region
from .rng import TrackerStates

__all__ = ["RegionCall"]


class RegionCall:
    """``fn`` for ``torch.utils.checkpoint.checkpoint``, called as ``call(*args, *kwarg_values)``.

    Args:
        fn: the region.
        region: its name and facts, for messages.
        kwarg_names: the names of the trailing arguments that are ``fn``'s
            keyword arguments (they travel positionally, so that torch saves
            their tensors like any other input).
        tracker: DeepSpeed's model-parallel RNG tracker to replay, or None.
        check: compare each recomputation's saved tensors with the forward's
            (torch's own errors are renamed to name the region either way).
        verify: also compare them op by op.
        placement: the region's input placement, for recomputation timing.
    """

    def __init__(self, fn: Callable[..., Any], region: Region, *, kwarg_names: tuple[str, ...] = (),
                 tracker: Any = None, check: bool = True, verify: bool = False,
                 placement: RegionPlacement | None = None):
        self.fn = fn
        self.region = region
        self.kwarg_names = kwarg_names
        self.tracker = tracker
        self.probe = SavedTensorProbe(region, compare=check)
        self.trace = OpTrace(region) if verify else None
        self.placement = placement
        self.tracker_states: TrackerStates | None = None
        self.forward_done = False
        self.recomputations = 0

    def _run(self, args: tuple) -> Any:
        if not self.kwarg_names:
            return self.fn(*args)
        split = len(args) - len(self.kwarg_names)
        return self.fn(*args[:split], **dict(zip(self.kwarg_names, args[split:])))

    def __call__(self, *args: Any) -> Any:
        if self.forward_done:
            return self._recompute(args)
        self.forward_done = True
        return self._forward(args)

    def _forward(self, args: tuple) -> Any:
        if self.tracker is not None:
            self.tracker_states = TrackerStates(self.tracker)
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.probe.recording(args))
            if self.trace is not None:
                stack.enter_context(self.trace)
            out = self._run(args)
        require_tensor_output(out, self.region)
        return out

    def _recompute(self, args: tuple) -> Any:
        self.recomputations += 1
        with contextlib.ExitStack() as stack:
            stack.enter_context(renamed(self.region))
            if self.placement is not None:
                stack.enter_context(self.placement.recomputing())
            if self.tracker_states is not None:
                stack.enter_context(self.tracker_states.replayed())
            stack.enter_context(self.probe.comparing(args))
            if self.trace is not None:
                stack.enter_context(self.trace.replaying())
            return self._run(args)
