"""Running one pipeline stage's layers as the planner measures them: every
layer its own checkpointed region, each observed by a
:class:`~.profile.LayerMeter`, in a training micro-batch (the measuring step)
or in a pass of its own at another micro-batch length, between steps.

It measures and returns the figures; it must not build the planning problem
(:mod:`.stage_problem`) nor decide when to measure (:mod:`.stage`).
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import memory
from .cost_model import predicted_peak_bytes
from .length_profiling import backward_through, isolated_from_training, modules_parameters
from .problem import StageProblem
from .profile import LayerMeter, StorageLedger, tensor_bytes
from .stage_problem import measured_segments

__all__ = ["StageMeasurement", "LengthMeasurement", "StageMeasurer", "detached", "FORWARD_ENDS",
           "BACKWARD_BEGINS", "PASS_ENDS"]

# The marks of a measured pass (and, on the last stage, of the measuring step):
# its loss phase runs from the end of the measured micro-batch's forward to that
# micro-batch's first recomputation.
FORWARD_ENDS = "ds_pipe_ckpt: forward end"
BACKWARD_BEGINS = "ds_pipe_ckpt: first recomputation"
PASS_ENDS = "ds_pipe_ckpt: measured pass end"


def detached(values: Any) -> tuple:
    """``values`` (a tensor or a tuple) as a tuple, each tensor detached and copied."""
    values = values if isinstance(values, tuple) else (values, )
    return tuple(v.detach().clone() if isinstance(v, torch.Tensor) else v for v in values)


@dataclass
class StageMeasurement:
    """The measuring step's micro-batch: its meters, and what the base is made of."""

    meters: list[LayerMeter]
    stage_input_bytes: int
    stage_output_bytes: int = 0
    stage_float_outputs: int = 0  # floating-point tensors the stage sends on

    @property
    def complete(self) -> bool:
        return all(meter.complete for meter in self.meters)

    def backward_keeps_graph(self, last_stage: bool) -> bool:
        """Whether the stage's backward keeps each micro-batch's graph to its
        end: as seen inside the recomputations, else (a torch that cannot tell)
        as DeepSpeed's engine does it, for a stage other than the last that
        sends several floating-point tensors (one ``backward`` per tensor, all
        but the last with ``retain_graph=True``)."""
        seen = [meter.backward_keeps_graph for meter in self.meters if meter.backward_keeps_graph is not None]
        if seen:
            return any(seen)
        return not last_stage and self.stage_float_outputs > 1


@dataclass(frozen=True)
class LengthMeasurement:
    """The stage measured at one micro-batch length (:meth:`StageMeasurer.measure_pass`)."""

    meters: list[LayerMeter]
    engine_bytes: int  # the engine's copies of one micro-batch's stage input and output
    workspace_bytes: int | None  # the pass's peak beyond the model (None: not measured)
    # The last stage: the pass's peak from its forward's end to its first
    # recomputation (its loss and the loss's backward; None: not measured)
    loss_phase_bytes: int | None = None
    output_bytes: int = 0  # the stage's output (on the last stage: the logits)


class StageMeasurer:
    """Runs ``module``'s (a :class:`~ds_pipe_ckpt.PipelineModule`'s) layers one
    checkpointed region each, with ``options(policy, **extra)`` the
    checkpoint options of a region, and measures them."""

    def __init__(self, module: Any, device: torch.device, options: Callable[..., Any], save_ops: Callable[[], tuple]):
        self.module = module
        self.device = device
        self.options = options
        self.save_ops = save_ops
        self.stage, self.last_stage = module.stage_id, module.stage_id == module.num_stages - 1

    def checkpointable(self, layer: int) -> bool:
        """Whether the pipeline's ``checkpointable_layers`` lets layer ``layer`` be checkpointed."""
        return self.module._is_checkpointable([self.module.forward_funcs[layer]])

    def new_meters(self, inputs: tuple, before_recomputation: Any = None, marker: Any = None) -> list[LayerMeter]:
        """One meter per layer, sharing a ledger of what is held whatever the
        plan: the stage input, and the parameters and buffers (a saved
        ``weight.t()`` is a view of one: it adds nothing); ``marker`` marks the
        memory tracker around each layer's forward (:class:`~.profile.LayerMeter`)."""
        module = self.module
        held = [t for t in inputs if isinstance(t, torch.Tensor)]
        held += [*module.parameters(), *module.buffers()]
        ledger = StorageLedger(held)
        save_ops = frozenset(self.save_ops())
        return [LayerMeter(module.segment_label(i, i + 1), ledger, save_ops, self.device, first_layer=i == 0,
                           checkpointable=self.checkpointable(i), before_recomputation=before_recomputation,
                           marker=marker)
                for i in range(len(module.forward_funcs))]

    def gradient_bytes_by_layer(self) -> list[int]:
        """Per local layer, the bytes of its parameters' gradients that each step
        allocates anew: those freed between steps (``zero_grad(set_to_none=True)``,
        so ``grad`` is None when the step begins; the others outlive the steps).
        A parameter used by several layers (a tied embedding and LM head) counts
        once, for the last of them, whose backward runs first."""
        seen: set[int] = set()
        by_layer = []
        for func in reversed(self.module.forward_funcs):
            total = 0
            for parameter in modules_parameters(func):
                if parameter.grad is None and id(parameter) not in seen:
                    seen.add(id(parameter))
                    total += parameter.numel() * parameter.element_size()
            by_layer.append(total)
        return by_layer[::-1]

    def run_per_layer(self, x: Any, seed_offset: int, options: Any, meters: list[LayerMeter] | None) -> Any:
        """Every layer its own checkpointed region (observed by ``meters``, when given)."""
        for i in range(len(self.module.forward_funcs)):
            meter = None if meters is None else meters[i]
            if not self.checkpointable(i):  # excluded by checkpointable_layers: runs plainly, always
                x = self._run_plain(x, i, seed_offset, meter)
                continue
            x = self.module.run_segment(x, i, i + 1, seed_offset, checkpointed=True, options=options, observer=meter)
        return x

    def _run_plain(self, x: Any, layer: int, seed_offset: int, meter: LayerMeter | None) -> Any:
        if meter is None:
            return self.module.run_segment(x, layer, layer + 1, seed_offset, checkpointed=False)
        inputs = x if isinstance(x, tuple) else (x, )
        return meter.forward(lambda args: self.module.run_segment(args, layer, layer + 1, seed_offset,
                                                                  checkpointed=False), inputs)

    def measure_pass(self, inputs: tuple, packed: bool, labels: tuple | None, length: int,
                     input_scale: float) -> LengthMeasurement:
        """The stage's layers measured on ``inputs`` (a micro-batch of ``length``;
        ``packed``: the stage takes them as a tuple), forward and backward (on
        the last stage through the loss of ``labels``), as in the measuring
        step, with the random streams, buffers and gradients left as they
        were; the bytes of that micro-batch's stage input and output in the
        engine; and the pass's peak beyond what the cost model predicts for it
        (the backward's workspace at that length), unless someone else profiles."""
        module = self.module
        parameters = [p for p in module.parameters() if p.requires_grad]
        tracking = memory.track_memory(self.device) if not torch.autograd._profiler_enabled() else None
        tracker = None

        def backward_begins() -> None:
            if tracker is not None and BACKWARD_BEGINS not in tracker.mark_names:
                tracker.mark(BACKWARD_BEGINS)

        def mark(name: str) -> None:
            if tracker is not None:
                tracker.mark(name)

        meters = self.new_meters(inputs, before_recomputation=backward_begins, marker=mark)
        with isolated_from_training(module, self.device):
            gc.collect()  # no earlier garbage freed inside the measured pass
            tracker = tracking.__enter__() if tracking is not None else None
            try:
                out = self.run_per_layer(inputs if packed else inputs[0], module.micro_offset + 1,
                                         self.options("full", early_stop=False), meters)
                outputs = out if isinstance(out, tuple) else (out, )
                if tracker is not None:
                    tracker.mark(FORWARD_ENDS)
                loss_fn = module.given_loss_fn
                ends = (loss_fn(out, labels[0] if len(labels) == 1 else labels), ) if labels is not None else outputs
                input_grads = backward_through(ends, [*parameters, *inputs])
                if tracker is not None:
                    tracker.mark(PASS_ENDS)
            finally:
                if tracking is not None:
                    tracking.__exit__(None, None, None)
        incomplete = [meter.name for meter in meters if not meter.complete]
        if incomplete:
            raise RuntimeError(f"ds_pipe_ckpt: pipeline stage {self.stage} could not measure "
                               f"{', '.join(incomplete)} at length {length}: its recomputation never ran")
        output_bytes = tensor_bytes(outputs)
        workspace = loss_phase = None
        if tracker is not None:
            for meter in meters:
                meter.read_forward_peak(tracker.report.marks, tracker.report.interval_peaks)
            # The pass as the cost model sees it: one micro-batch, every layer
            # checkpointed, each layer's parameter gradients allocated by its
            # backward; its output, the output's gradient and the input's gradient held.
            layers = tuple(dataclasses.replace(meter.profile(input_scale),
                                               grad_bytes=sum(p.numel() * p.element_size() for p in
                                                              modules_parameters(module.forward_funcs[i])))
                           for i, meter in enumerate(meters))
            problem = StageProblem(layers=layers, in_flight=1, budget_bytes=0,
                                   base_bytes=2 * output_bytes + input_grads, label=f"pipeline stage {self.stage}")
            modelled = predicted_peak_bytes(problem, measured_segments(problem))
            peaks = tracker.report.interval_peaks
            workspace = max(0, peaks.get(PASS_ENDS, tracker.report.peak_bytes) - modelled)
            loss_phase = peaks.get(BACKWARD_BEGINS) if labels is not None else None
        engine = tensor_bytes(inputs) + (0 if self.last_stage else output_bytes)
        return LengthMeasurement(meters, engine, workspace, loss_phase, output_bytes)
