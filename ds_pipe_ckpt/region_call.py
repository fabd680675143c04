"""The function torch's checkpoint runs for one region.

torch calls it once for the forward and once per recomputation; it is the one
place that tells the two apart. Around the forward it records what the
recomputation must reproduce (DeepSpeed's model-parallel RNG states, the
module buffers the forward changes as they were before it, the tensors the
region saves, with ``verify_recompute`` every op; on the region's first call,
whether it saves anything beyond its inputs and parameters); around each recomputation
it replays and checks them, inside the region placement's synchronisation and
timing, and leaves the modules' buffers as the forward left them
(:mod:`ds_pipe_ckpt.module_state`).

It runs on every checkpointed call, so it is written for that: one slotted
object per call, plain code rather than stacked context managers, and the
region's function called directly unless keyword arguments, an op trace or an
observer need a wrapper.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .inputs import unexpected_modification
from .module_state import KeptBuffers, keep_buffers
from .placement.runtime import RegionPlacement
from .op_trace import OpTrace
from .recompute import STOP_RECOMPUTATION, SavedTensorProbe, renamed, require_tensor_output
from .regions import Region, modules_of
from .saved_inputs import SavedTensorLearner

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
        observer: something that watches the forward and the recomputation
            (``observer.forward(run, args)`` and ``observer.recomputation(run,
            args)`` call ``run(args)`` and return its result), e.g. the
            planner's per-layer measurement; None on the usual path.
    """

    __slots__ = ("fn", "region", "kwarg_names", "tracker", "probe", "trace", "placement", "observer", "plain",
                 "tracker_states", "buffers", "forward_done")

    def __init__(self, fn: Callable[..., Any], region: Region, *, kwarg_names: tuple[str, ...] = (),
                 tracker: Any = None, check: bool = True, verify: bool = False,
                 placement: RegionPlacement | None = None, observer: Any = None):
        self.fn = fn
        self.region = region
        self.kwarg_names = kwarg_names
        self.tracker = tracker
        # A region whose saved tensors have not been seen yet learns them (SavedTensorLearner).
        probe = SavedTensorProbe if region.facts.saves_only_inputs is not None else SavedTensorLearner
        self.probe = probe(region, compare=check)
        self.trace = OpTrace(region) if verify else None
        self.placement = placement
        self.observer = observer
        # Nothing needs to stand between the probe and the region's function: the
        # probe calls it directly (else through _forward_run / _recomputation_run).
        self.plain = not kwarg_names and not verify and observer is None
        self.tracker_states: dict | None = None  # the tracker's states when the forward started
        self.buffers: KeptBuffers | None = None  # module buffers the forward changed, as before it
        self.forward_done = False

    # -- the region's function, as the probe runs it: run(*args) ----------------------

    def _forward_run(self, *args: Any) -> Any:
        if self.observer is not None:
            return self.observer.forward(self._call_recording, args)
        return self._call_recording(args)

    def _recomputation_run(self, *args: Any) -> Any:
        if self.observer is not None:
            return self.observer.recomputation(self._call_replaying, args)
        return self._call_replaying(args)

    def _call_recording(self, args: tuple) -> Any:
        if self.trace is not None:
            with self.trace:
                return self._call(args)
        return self._call(args)

    def _call_replaying(self, args: tuple) -> Any:
        if self.trace is not None:
            with self.trace.replaying():
                return self._call(args)
        return self._call(args)

    def _call(self, args: tuple) -> Any:
        if not self.kwarg_names:
            return self.fn(*args)
        split = len(args) - len(self.kwarg_names)
        return self.fn(*args[:split], **dict(zip(self.kwarg_names, args[split:])))

    # -- torch's calls -------------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        if self.forward_done:
            return self._recompute(args)
        self.forward_done = True
        # The forward. Written for the per-call cost: plain loops, no comprehensions (each is a call).
        tracker = self.tracker
        if tracker is not None and tracker.states_:
            # No streams (no model-parallel seed set): nothing to replay. get_states()
            # copies the dict; fork() replaces entries, never mutates them.
            self.tracker_states = tracker.get_states()
        region = self.region
        facts = region.facts
        grad = torch.is_grad_enabled()
        # A region known to leave its inputs alone has no private copies
        # (ds_pipe_ckpt.inputs): if it modifies one now, say so here.
        watched = []  # (position among the tensor inputs, tensor, version)
        if grad and facts.mutated_inputs is not None and not facts.mutated_inputs:
            for value in args:
                if isinstance(value, torch.Tensor):
                    watched.append((len(watched), value, value._version))
        run = self.fn if self.plain else self._forward_run
        # Module buffers the forward changes (ds_pipe_ckpt.module_state); owners == (): none at all.
        buffers = keep_buffers(region, self.fn) if grad and facts.buffers.owners != () else None
        forward = self.probe.run_forward
        if grad and facts.saves_only_inputs is None:
            forward = self._learn_forward
        if buffers is None:
            out = forward(run, args)
        else:
            out = buffers.run_forward(lambda a: forward(run, a), args)
            self.buffers = buffers or None
        for position, tensor, version in watched:
            if tensor._version != version:
                raise unexpected_modification(
                    region, [p for p, t, v in watched if t._version != v])
        if not isinstance(out, torch.Tensor):
            require_tensor_output(out, region)
        return out

    def _learn_forward(self, run: Callable[..., Any], args: tuple) -> Any:
        region = self.region
        return self.probe.learn_forward(
            run, args, lambda: region.modules if region.modules is not None else modules_of(self.fn))

    def _recompute(self, args: tuple) -> Any:
        placement, tracker, states = self.placement, self.tracker, self.tracker_states
        started = placement.begin_recomputation() if placement is not None else None
        live = live_buffers = None
        if states is not None:
            live = tracker.get_states()
            tracker.set_states(dict(states))
        buffers = self.buffers
        if buffers is not None:
            live_buffers = buffers.swap_in()
        try:
            return self.probe.run_recomputation(self.fn if self.plain else self._recomputation_run, args)
        except STOP_RECOMPUTATION:  # torch's early stop, on every recomputation
            raise
        except Exception as error:
            replacement = renamed(self.region, error)
            if replacement is None:
                raise
            raise replacement from error
        finally:
            if live_buffers is not None:
                buffers.swap_out(live_buffers)
            if live is not None:
                tracker.set_states(live)
            if placement is not None:
                placement.end_recomputation(started)
