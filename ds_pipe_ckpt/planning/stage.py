"""The planner at work inside one pipeline stage's ``PipelineModule.forward``.

Life of a :class:`StagePlanner` (``activation_checkpointing.memory_budget_mb``
set; ``ds_pipe_ckpt.initialize`` creates it through
``PipelineModule.enable_planning``):

1. **Until planned: measure.** Every local layer runs as its own
   checkpointed region (the memory-safe choice while nothing is known). On the
   second training micro-batch (the first warms up: lazy initialisation and
   first-call allocations would inflate its times) each region carries a
   :class:`~ds_pipe_ckpt.planning.profile.LayerMeter`, and its recomputation runs
   to the end so that every op is seen.
2. **The next step's start: plan.** The measurements, the micro-batches
   this stage keeps in flight under DeepSpeed's 1F1B ``TrainSchedule``
   (``min(stages - stage, micro_batches)``) and the budget go to the exact
   solver (:func:`~ds_pipe_ckpt.planning.solver.plan_stage`). The plan is
   printed (one table per stage, on the stage's first rank), exposed as
   ``PipelineModule.checkpoint_plan``, and followed from this step on: each
   segment is stored, checkpointed, or checkpointed selectively. A budget no
   plan fits raises :class:`~ds_pipe_ckpt.ConfigError` naming the smallest
   budget that fits, on every rank of the job at once (the planning is
   agreed at each step start where a stage may plan, :mod:`.agreement`), so
   that no stage is left waiting for one that stopped.
3. **The first planned step: check.** Its peak memory (bytes above the step's
   start, by :mod:`ds_pipe_ckpt.memory`) is measured and compared with the
   prediction. The step starts where DeepSpeed's ``train_batch()`` calls
   ``module.train()``, before the stage receives its first activations (or at
   the step's first forward where nothing calls it), and ends with the
   optimizer step (or where the next one starts, where no torch optimizer
   steps). A prediction off by more than :data:`PREDICTION_TOLERANCE`, or a
   measured peak above the budget, is a :class:`PlanPredictionWarning` naming the stage; the stage
   plans again at the next step's start (gradients are freed then, as when it
   first planned) with the difference counted as memory the model does not see
   (in its ``base``), and checks the new plan in that step (at most twice). On
   CPU that measurement runs the torch profiler: a step someone else profiles
   is left alone and the next one is checked.

What the model does not vary with the plan is its ``base``: the engine's
buffers for the micro-batches in flight (stage inputs and outputs) and the
incoming and outgoing gradients. The parameters' gradients, when they are
freed between steps (``zero_grad(set_to_none=True)``), come back layer by layer
during the backward; the cost model places them (``LayerProfile.grad_bytes``).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import memory
from ..errors import ConfigError
from ..selective import ops_to_keep
from ..settings import current_settings
from .cost_model import (SMALL_ALLOCATIONS_MIN_BYTES, SMALL_ALLOCATIONS_SHARE, ChainCosts, Decision, LayerProfile,
                         Segment, StageProblem, gradients_as_base, predicted_peak_bytes)
from .agreement import agree
from .length_plans import plan_lengths
from .length_profiling import backward_through, isolated_from_training, modules_parameters
from .planned import PlannedStage
from .profile import LayerMeter, StorageLedger, tensor_bytes
from .shapes import SequenceLengths
from .solver import InfeasibleBudgetError, plan_stage
from .stage_phase import StageEvent, StagePhase, next_phase

__all__ = ["StagePlanner", "PlannedStage", "PlanPredictionWarning", "KnownBuffer", "PREDICTION_TOLERANCE"]

PREDICTION_TOLERANCE = 0.10  # how far a plan's predicted peak may be from the measured one
# The measuring step's marks on the last stage: its loss phase runs from the end of
# the measured micro-batch's forward to that micro-batch's first recomputation.
FORWARD_ENDS = "ds_pipe_ckpt: forward end"
BACKWARD_BEGINS = "ds_pipe_ckpt: first recomputation"
PASS_ENDS = "ds_pipe_ckpt: measured pass end"  # a length's measured pass (StagePlanner._measure_length)
MIB = 2**20
MAX_CALIBRATIONS = 2  # plans made again after a measured step that did not fit the prediction
# max_memory_mb "auto": a CUDA device's capacity less this share, for what the
# caching allocator's counters do not see: the CUDA context, NCCL's buffers and
# the allocator's fragmentation.
AUTO_MARGIN = 0.10


@dataclass(frozen=True)
class KnownBuffer:
    """Memory outside the activations that the engine is known to allocate in
    every step (e.g. ZeRO's reduce bucket): named in the plan's floor."""

    description: str
    bytes: int
    fix: str = ""


class PlanPredictionWarning(UserWarning):
    """A stage's measured peak memory was above its plan's prediction, or
    above the budget; or a stage could not be measured (and stays unplanned)."""


def _detached(values: Any) -> tuple:
    """``values`` (a tensor or a tuple) as a tuple, each tensor detached and copied."""
    values = values if isinstance(values, tuple) else (values, )
    return tuple(v.detach().clone() if isinstance(v, torch.Tensor) else v for v in values)


@dataclass(frozen=True)
class _LengthMeasurement:
    """The stage measured at one micro-batch length (``StagePlanner._measure_length``)."""

    meters: list[LayerMeter]
    engine_bytes: int  # the engine's copies of one micro-batch's stage input and output
    workspace_bytes: int | None  # the pass's peak beyond the model (None: not measured)
    # The last stage: the pass's peak from its forward's end to its first
    # recomputation (its loss and the loss's backward; None: not measured)
    loss_phase_bytes: int | None = None
    output_bytes: int = 0  # the stage's output (on the last stage: the logits)


@dataclass
class _Measurement:
    """The first micro-batch's meters, and what the base is made of."""

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


class StagePlanner:
    """Runs one stage's forward as measured, then as planned (module docstring)."""

    def __init__(self, module: Any, *, budget_bytes: int | None, micro_batches: int,
                 known_buffers: tuple[KnownBuffer, ...] = (), max_memory_bytes: int | str | None = None,
                 lengths: SequenceLengths | None = None):
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.module = module
        # With max_memory_bytes the budget is known once the measuring step has
        # shown what a step starts with (_resolve_budget).
        self.budget_bytes = budget_bytes
        self.max_memory_bytes = max_memory_bytes
        self.step_start_bytes: int | None = None  # allocated when the measuring step began
        self.budget_key = "activation_checkpointing." + ("memory_budget_mb" if max_memory_bytes is None
                                                         else "max_memory_mb")
        self.micro_batches = micro_batches
        self.known_buffers = known_buffers
        self.stage, self.num_stages = module.stage_id, module.num_stages
        self.in_flight = min(self.num_stages - self.stage, micro_batches)
        self.forwards = 0  # training (grad-enabled) forwards so far
        self.measurement: _Measurement | None = None
        self.planned: PlannedStage | None = None
        self._tracking: Any = None  # the memory tracking context of the checked step
        self._tracker: memory.MemoryTracker | None = None
        self._tracker_start_bytes = 0
        self._step_end_hook: Any = None
        self.phase = StagePhase.MEASURING  # planning.stage_phase; moved only by _advance
        # Whether this step start's planning is agreed with every rank (planning.agreement):
        # from the step after the measuring step, while any rank may still plan.
        self._agreement_due = False
        self._step_begun = False  # module.train() began the step before its first forward
        self._measuring_step = False  # the tracked step is the measuring step, not a planned one
        self._first_step = False  # the tracked step is the first step (no plan yet)
        # The first step's peak and what it left allocated (None: not measured).
        self.first_step_peak_bytes: int | None = None
        self.first_step_kept_bytes: int | None = None
        self.measuring_step_peak_bytes: int | None = None  # the whole measuring step's peak
        # The last stage: the measuring step's peak from the measured micro-batch's forward
        # end to its first recomputation (the loss, its backward, the layers stored anyway),
        # None where that was not seen
        self.loss_phase_peak_bytes: int | None = None
        self.backward_start_extra_bytes = 0  # what that phase showed beyond the model's k * H
        self.unmeasured: list[str] = []  # layers the measuring step could not measure (then no plan)
        self.calibrations = 0
        self.unmodelled_bytes = 0  # what measured steps showed beyond the model (>= 0)
        # Variable-length micro-batches (dynamic_shape=True): the lengths planned for, the
        # measured micro-batch (kept until the first plan, to measure the layers at every
        # bucket's length) and its length.
        self.lengths = lengths
        self._measured_sample: Any = None
        self._length_measurements: dict[int, _LengthMeasurement] | None = None
        # The last stage's measured micro-batch's labels, for the loss in every length's pass.
        self._labels_wanted = lengths is not None and self.stage == self.num_stages - 1
        self._measured_labels: Any = None
        # The measuring step's unmodelled bytes, in parts (set with the first plan).
        self._measured_rebuild_extra_bytes = self._measured_margin_bytes = self._measured_boundary_bytes = 0
        self._measured_start_extra_bytes = 0
        self.measured_length: int | None = None
        self.planning_s = 0.0  # the planner's own time (measuring every length, solving), over the run
        self.device = next((p.device for p in module.parameters()), torch.device("cpu"))
        if max_memory_bytes == "auto":
            if self.device.type != "cuda":
                raise ConfigError(self.budget_key, "auto", "a number of MiB on a device other than CUDA",
                                  f"\"auto\" is a CUDA device's capacity; pipeline stage {self.stage} runs on "
                                  f"{self.device.type}.")
            capacity = torch.cuda.get_device_properties(self.device).total_memory
            self.max_memory_bytes = int(capacity * (1 - AUTO_MARGIN))
        if self.device.type == "cpu":
            memory.track_cpu_allocations()  # before the tensors the checked step frees exist

    # -- forward ----------------------------------------------------------------------

    def forward(self, x: Any, seed_offset: int) -> Any:
        module = self.module
        layers = len(module.forward_funcs)
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward
            return module.run_segment(x, 0, layers, seed_offset, checkpointed=False)
        self.training_step_may_begin()  # where nothing called module.train(): at the step's first forward
        self._step_begun = False
        edge = None
        if self.lengths is not None:  # before anything of this micro-batch runs
            where = f"pipeline stage {self.stage} (micro-batch {module.micro_offset})"
            edge = self.lengths.edge_for(self.lengths.length_of(x if isinstance(x, tuple) else (x, ), where), where)
        self.forwards += 1
        if self.planned is None:
            return self._forward_per_layer(x, seed_offset)
        plan = self.planned.plan if edge is None else self.planned.lengths.for_edge(edge).plan
        for segment in plan.segments:
            if segment.decision is Decision.STORE:
                x = module.run_segment(x, segment.start, segment.end, seed_offset, checkpointed=False)
            else:
                policy = "selective" if segment.decision is Decision.SELECTIVE else "full"
                x = module.run_segment(x, segment.start, segment.end, seed_offset, checkpointed=True,
                                       options=self._options(policy))
        return x

    def _options(self, policy: str, **extra: Any) -> Any:
        return current_settings().options(use_reentrant=False, policy=policy, **extra)

    def _forward_per_layer(self, x: Any, seed_offset: int) -> Any:
        module = self.module
        layers = len(module.forward_funcs)
        # The first micro-batch of the second step: the first step warms up (lazy
        # initialisation, first-call allocations, the engine's and the optimizer's
        # buffers), and the whole second step is tracked (see _step_begins).
        measure = self.measurement is None and self.forwards == self.micro_batches + 1
        if measure:
            inputs = x if isinstance(x, tuple) else (x, )
            meters = self._new_meters(inputs, before_recomputation=self._backward_begins)
            self.measurement = _Measurement(meters, stage_input_bytes=tensor_bytes(inputs))
            if self.lengths is not None:
                self._measured_sample = _detached(inputs), isinstance(x, tuple)
                self.measured_length = self.lengths.length_of(inputs, f"pipeline stage {self.stage}")
            self._agreement_due = True  # every stage measures in the same step, and plans at the next one's start
            # Recomputations run to the end, so that the meters see every op.
            options = self._options("full", early_stop=False)
        else:
            options = self._options("full")
        x = self._run_per_layer(x, seed_offset, options, self.measurement.meters if measure else None)
        if measure:
            self._mark_once(FORWARD_ENDS)
            outputs = x if isinstance(x, tuple) else (x, )
            self.measurement.stage_output_bytes = tensor_bytes(outputs)
            self.measurement.stage_float_outputs = sum(isinstance(t, torch.Tensor) and t.is_floating_point()
                                                       for t in outputs)
        return x

    def _run_per_layer(self, x: Any, seed_offset: int, options: Any, meters: list[LayerMeter] | None) -> Any:
        """Every layer its own checkpointed region (observed by ``meters``, when given)."""
        for i in range(len(self.module.forward_funcs)):
            meter = None if meters is None else meters[i]
            if not self._checkpointable(i):  # excluded by checkpointable_layers: runs plainly, always
                x = self._run_plain(x, i, seed_offset, meter)
                continue
            x = self.module.run_segment(x, i, i + 1, seed_offset, checkpointed=True, options=options, observer=meter)
        return x

    def _new_meters(self, inputs: tuple, before_recomputation: Any = None) -> list[LayerMeter]:
        """One meter per layer, sharing a ledger of what is held whatever the
        plan: the stage input, and the parameters and buffers (a saved
        ``weight.t()`` is a view of one: it adds nothing)."""
        module = self.module
        held = [t for t in inputs if isinstance(t, torch.Tensor)]
        held += [*module.parameters(), *module.buffers()]
        ledger = StorageLedger(held)
        save_ops = frozenset(self._save_ops())
        return [LayerMeter(module.segment_label(i, i + 1), ledger, save_ops, self.device, first_layer=i == 0,
                           checkpointable=self._checkpointable(i), before_recomputation=before_recomputation)
                for i in range(len(module.forward_funcs))]

    def _measure_length(self, length: int) -> _LengthMeasurement:
        """The stage's layers measured on the measured micro-batch cut or
        padded to ``length`` (every layer its own checkpointed region,
        forward and backward, as in the measuring step), between steps, with
        the random streams, buffers and gradients left as they were; the
        bytes of that micro-batch's stage input and output in the engine; and
        the pass's peak beyond what the cost model predicts for it (the
        backward's workspace at that length), unless someone else profiles."""
        sample, packed = self._measured_sample
        inputs = self.lengths.resized(sample, self.measured_length, length)
        labels = None
        if self._measured_labels is not None:
            labels = self.lengths.resized(self._measured_labels, self.measured_length, length)
        parameters = [p for p in self.module.parameters() if p.requires_grad]
        tracking = memory.track_memory(self.device) if not torch.autograd._profiler_enabled() else None
        tracker = None

        def backward_begins() -> None:
            if tracker is not None and BACKWARD_BEGINS not in tracker.mark_names:
                tracker.mark(BACKWARD_BEGINS)

        meters = self._new_meters(inputs, before_recomputation=backward_begins)
        with isolated_from_training(self.module, self.device):
            gc.collect()  # no earlier garbage freed inside the measured pass
            tracker = tracking.__enter__() if tracking is not None else None
            try:
                out = self._run_per_layer(inputs if packed else inputs[0], self.module.micro_offset + 1,
                                          self._options("full", early_stop=False), meters)
                outputs = out if isinstance(out, tuple) else (out, )
                if tracker is not None:
                    tracker.mark(FORWARD_ENDS)
                loss_fn = self.module.given_loss_fn
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
            # The pass as the cost model sees it: one micro-batch, every layer
            # checkpointed, each layer's parameter gradients allocated by its
            # backward; its output, the output's gradient and the input's gradient held.
            layers = tuple(dataclasses.replace(meter.profile(self._input_scale()),
                                               grad_bytes=sum(p.numel() * p.element_size() for p in
                                                              modules_parameters(self.module.forward_funcs[i])))
                           for i, meter in enumerate(meters))
            problem = StageProblem(layers=layers, in_flight=1, budget_bytes=0,
                                   base_bytes=2 * output_bytes + input_grads, label=f"pipeline stage {self.stage}")
            modelled = predicted_peak_bytes(problem, self._measured_segments(problem))
            peaks = tracker.report.interval_peaks
            workspace = max(0, peaks.get(PASS_ENDS, tracker.report.peak_bytes) - modelled)
            loss_phase = peaks.get(BACKWARD_BEGINS) if labels is not None else None
        engine = tensor_bytes(inputs) + (0 if self.stage == self.num_stages - 1 else output_bytes)
        return _LengthMeasurement(meters, engine, workspace, loss_phase, output_bytes)

    def observed_loss(self, loss_fn: Any) -> Any:
        """``module.loss_fn`` as the engine calls it: the loss itself, or, for the
        measured micro-batch's loss on the last stage with variable lengths,
        the loss that keeps its labels, with which every length's measured
        pass runs the loss too."""
        if self._labels_wanted and self.forwards == self.micro_batches + 1:
            def keep_labels(outputs: Any, labels: Any) -> Any:
                self._labels_wanted = False
                self._measured_labels = _detached(labels)
                return loss_fn(outputs, labels)

            return keep_labels
        return loss_fn

    def _mark_once(self, name: str) -> None:
        """On the last stage, during the measuring step: mark ``name`` (once)."""
        if (self.stage == self.num_stages - 1 and self._tracker is not None and self._measuring_step
                and name not in self._tracker.mark_names):
            self._tracker.mark(name)

    def _backward_begins(self) -> None:
        """The measured micro-batch's first recomputation is about to run."""
        if self._tracker is not None and FORWARD_ENDS in self._tracker.mark_names:
            self._mark_once(BACKWARD_BEGINS)

    def _checkpointable(self, layer: int) -> bool:
        """Whether the pipeline's ``checkpointable_layers`` lets layer ``layer`` be checkpointed."""
        return self.module._is_checkpointable([self.module.forward_funcs[layer]])

    def _run_plain(self, x: Any, layer: int, seed_offset: int, meter: LayerMeter | None) -> Any:
        if meter is None:
            return self.module.run_segment(x, layer, layer + 1, seed_offset, checkpointed=False)
        inputs = x if isinstance(x, tuple) else (x, )
        return meter.forward(lambda args: self.module.run_segment(args, layer, layer + 1, seed_offset,
                                                                  checkpointed=False), inputs)

    @staticmethod
    def _save_ops() -> tuple:
        return ops_to_keep(current_settings().config.save_ops)

    # -- step boundaries ----------------------------------------------------------------

    def training_step_may_begin(self) -> None:
        """``module.train()`` was called: DeepSpeed's ``train_batch()`` does so
        before anything else, so when this stage is between steps, the step
        begins here, before the engine receives (allocates) its first activations."""
        if self.forwards % self.micro_batches == 0 and not self._step_begun:
            self._step_begins()
            self._step_begun = True

    def _step_begins(self) -> None:
        """At the start of a step (``module.train()`` or its first forward), the
        previous one (forwards, backwards, optimizer step) is complete on this stage."""
        if self._tracking is not None:
            self._finish_tracking()
        error = None
        try:
            self._plan_if_due()
        except Exception as raised:  # agreed below with every rank, then raised on all of them
            if not self._agreement_due:
                raise
            error = raised
        if self._agreement_due:
            may_plan_again = self.phase in (StagePhase.CHECKING, StagePhase.REPLAN_DUE) and error is None
            self._agreement_due = agree(self.stage, error, may_plan_again)
        measuring = self.measurement is None and self.forwards == self.micro_batches
        first = self.forwards == 0
        if (first or measuring or self.phase in (StagePhase.CHECKING, StagePhase.REPLAN_DUE)) \
                and not torch.autograd._profiler_enabled():
            # Garbage made before the step (reference cycles, which the collector
            # frees at an arbitrary allocation) must not be freed inside the tracked
            # step: its size would lower the measured peak. A few steps only.
            gc.collect()
            self._measuring_step, self._first_step = measuring, first
            self._tracking = memory.track_memory(self.device)
            self._tracker = self._tracking.__enter__()
            # The step ends with the optimizer step (DeepSpeed's last instruction).
            self._step_end_hook = register_optimizer_step_post_hook(lambda *_: self._finish_tracking())

    def _plan_if_due(self) -> None:
        """Plan again after a checked step that did not fit its prediction, or
        for the first time after the measuring step."""
        if self.phase is StagePhase.REPLAN_DUE:
            checked = self.planned
            self._advance(StageEvent.REPLANNING)
            self.planned = self._plan()
            self.planned.earlier_checks = (*checked.earlier_checks,
                                           (checked.predicted_peak_bytes, checked.measured_peak_bytes))
            self._announce()
        if self.phase is StagePhase.MEASURING and self.measurement is not None:
            if self.measurement.complete:
                self.planned = self._plan()
                self._advance(StageEvent.PLANNED)
                self._announce()
            else:
                self._refuse_incomplete_measurement()
                self._advance(StageEvent.MEASUREMENT_INCOMPLETE)

    def _advance(self, event: StageEvent) -> None:
        self.phase = next_phase(self.phase, event)

    def _refuse_incomplete_measurement(self) -> None:
        """The measuring step ended without every layer measured: say which, and
        stay unplanned (every layer checkpointed) rather than guess."""
        self.unmeasured = [meter.name for meter in self.measurement.meters if not meter.complete]
        warnings.warn(PlanPredictionWarning(
            f"ds_pipe_ckpt: pipeline stage {self.stage} cannot plan its checkpointing: the recomputation of "
            f"{', '.join(self.unmeasured)} never ran during the measuring step's backward, so what it costs is "
            "unknown. The stage keeps checkpointing every layer (no plan, no budget check). Usual cause: the "
            "layer's output does not reach the loss (its backward never runs); exclude such layers from "
            "checkpointing with PipelineModule(checkpointable_layers=[...])."), stacklevel=3)

    def _base_bytes(self) -> int:
        """What does not depend on the plan: the engine's copies of the inputs
        and outputs of the micro-batches in flight, plus one incoming and one
        outgoing gradient. The last stage's output (the logits) and its
        gradient live only from its forward's end to the loss's backward: the
        measuring step's loss phase shows them (``backward_start_bytes``)."""
        measured = self.measurement
        output = 0 if self.stage == self.num_stages - 1 else measured.stage_output_bytes
        return (self.in_flight + 1) * (measured.stage_input_bytes + output)

    def _gradient_bytes_by_layer(self) -> list[int]:
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

    def _input_scale(self) -> float:
        """The fraction of a checkpointed input kept on the device."""
        settings = current_settings()
        config, group = settings.config, settings.model_parallel
        if config.cpu_checkpointing:
            return 0.0
        if config.partition_activations and group is not None and group.world_size > 1:
            return 1.0 / group.world_size
        return 1.0

    def _problem(self, meters: list[LayerMeter] | None = None, engine_bytes: int | None = None) -> StageProblem:
        """The solver's problem for this stage, with the memory measured steps
        showed beyond the model counted in its base. By default from the
        measuring step; else from ``meters``, with ``engine_bytes`` the
        engine's copies of one micro-batch's stage input and output."""
        scale = self._input_scale()
        layers: tuple[LayerProfile, ...] = tuple(
            dataclasses.replace(meter.profile(scale), grad_bytes=grads)
            for meter, grads in zip(meters or self.measurement.meters, self._gradient_bytes_by_layer()))
        layers, gradients = gradients_as_base(layers, self.in_flight, self.micro_batches)
        engine = self._base_bytes() if engine_bytes is None else (self.in_flight + 1) * engine_bytes
        keeps_graph = self.measurement.backward_keeps_graph(last_stage=self.stage == self.num_stages - 1)
        return StageProblem(layers=layers, in_flight=self.in_flight, budget_bytes=self.budget_bytes,
                            base_bytes=engine + gradients + self.unmodelled_bytes,
                            label=f"pipeline stage {self.stage}", backward_keeps_graph=keeps_graph,
                            backward_start_bytes=self.backward_start_extra_bytes)

    def _measured_segments(self, problem: StageProblem) -> list[Segment]:
        """What the measuring step ran: every checkpointable layer its own
        checkpoint region, the others stored."""
        return [Segment(i, i + 1, Decision.CHECKPOINT if layer.checkpointable else Decision.STORE)
                for i, layer in enumerate(problem.layers)]

    def _resolve_budget(self) -> None:
        """With max_memory_bytes: the budget is what the measuring step began with, taken from it."""
        if self.budget_bytes is not None:
            return
        if self.step_start_bytes is None:  # the measuring step was profiled by someone else: not measured
            raise ConfigError(self.budget_key, round(self.max_memory_bytes / MIB, 3),
                              "a budget measured on the stage's second step",
                              f"Pipeline stage {self.stage}'s second step ran under another profiler, so what a "
                              "step begins with is unknown; leave that step unprofiled, or use memory_budget_mb.")
        if self.max_memory_bytes <= self.step_start_bytes:
            raise ConfigError(self.budget_key, round(self.max_memory_bytes / MIB, 3),
                              f"more than the {self.step_start_bytes / MIB:.2f} MiB allocated when a step begins "
                              f"on pipeline stage {self.stage}",
                              "That is the parameters, their gradients where they outlive steps, and the "
                              "optimizer's state: nothing is left for the step itself.")
        self.budget_bytes = self.max_memory_bytes - self.step_start_bytes

    def _plan(self) -> PlannedStage:
        started = time.perf_counter()
        try:
            planned = self._make_plan()
        finally:
            self.planning_s += time.perf_counter() - started
        planned.planning_s = self.planning_s
        return planned

    def _make_plan(self) -> PlannedStage:
        self._resolve_budget()
        problem = self._problem()
        if self.measuring_step_peak_bytes is not None and self.planned is None and not self.calibrations:
            # The measuring step is a whole step of a known plan: what it measured
            # beyond that plan's prediction (the backward's workspace, the engine's
            # and the optimizer's buffers, ZeRO's reduce bucket) is there whatever
            # the plan. Counted from the first plan on, so that it is an upper bound.
            # Two things it cannot carry over are counted on top: small allocations
            # (a share of the peak), and one activation gradient in flight, which the
            # backward holds at a segment boundary while it computes the next: the
            # measuring step's peak (inside a layer's recomputation) shows it there,
            # but a plan that moves its peak elsewhere (the start of the backward,
            # or a segment boundary after stored layers) meets one more of it.
            #
            # On the last stage, the loss phase (its logits, the loss and their
            # gradients) is compared with the model's k * H term on its own, so that
            # it is not charged to the rebuilds, which never meet it.
            measured_segments = self._measured_segments(problem)
            modelled = predicted_peak_bytes(problem, measured_segments)
            margin = max(SMALL_ALLOCATIONS_MIN_BYTES, int(SMALL_ALLOCATIONS_SHARE * self.measuring_step_peak_bytes))
            rebuild_extra = max(0, self.measuring_step_peak_bytes - modelled)
            start_extra = 0
            if self.loss_phase_peak_bytes is not None:
                held = sum(ChainCosts(problem).cost(s.start, s.end, s.decision).held_bytes for s in measured_segments)
                # The measuring step's first micro-batch meets no parameter gradient yet
                # (they come with its backward): compared with the engine's part of base.
                start_extra = max(0, self.loss_phase_peak_bytes - (self._base_bytes() + self.in_flight * held))
            boundary = self._largest_boundary_bytes(problem)  # the rebuilds' margin: not the start's
            self.unmodelled_bytes = rebuild_extra + margin + boundary
            # Its parts, for other micro-batch lengths (_unmodelled_growth).
            self._measured_rebuild_extra_bytes, self._measured_margin_bytes = rebuild_extra, margin
            self._measured_boundary_bytes, self._measured_start_extra_bytes = boundary, start_extra
            self.backward_start_extra_bytes = max(0, start_extra - rebuild_extra - boundary)
            problem = self._problem()
        length_plans = engine_bytes = unmodelled = None
        if self.lengths is not None:
            problems, engine_by_length = self._length_problems()
            problem = problems[self.lengths.max_length]
            engine_bytes = (self.in_flight + 1) * engine_by_length[self.lengths.max_length]
            unmodelled = self.unmodelled_bytes + sum(self._unmodelled_growth(self.lengths.max_length, problem))
        try:
            if self.lengths is not None:
                length_plans = plan_lengths(problems, engine_by_length)
                plan = length_plans.longest.plan
            else:
                plan = plan_stage(problem)
        except InfeasibleBudgetError as error:
            # In the key's own terms: max_memory_mb counts what a step begins with too.
            start = self.step_start_bytes if self.max_memory_bytes is not None else 0
            configured = self.budget_bytes + start
            smallest = (error.minimum_bytes + start) / MIB
            counted = (f" (with the {start / MIB:.2f} MiB allocated when a step begins: parameters, gradients that "
                       "outlive steps, optimizer state)" if start else "")
            longest = (f" or activation_checkpointing.max_sequence_length ({self.lengths.max_length}: the "
                       "longest micro-batch planned for)" if self.lengths is not None else "")
            raise ConfigError(
                self.budget_key, round(configured / MIB, 3),
                f"at least {smallest:.2f} MiB for pipeline stage {self.stage}",
                f"No plan keeps this stage's predicted peak within the budget ({self.in_flight} micro-batch(es) "
                f"in flight; measured on its first micro-batches); {smallest:.2f} MiB is the smallest that fits"
                f"{counted}. {self.floor(problem, error.minimum_bytes, engine_bytes, unmodelled)} Raise the budget, lower "
                f"the micro-batch size{longest}, or use more stages.") from error
        return PlannedStage(stage=self.stage, num_stages=self.num_stages, in_flight=self.in_flight,
                            budget_bytes=self.budget_bytes, problem=problem, plan=plan,
                            step_start_bytes=self.step_start_bytes if self.max_memory_bytes is not None else None,
                            measuring_step_peak_bytes=self.measuring_step_peak_bytes, lengths=length_plans,
                            first_step_peak_bytes=self.first_step_peak_bytes,
                            first_step_kept_bytes=self.first_step_kept_bytes,
                            measured_length=self.measured_length)

    def _length_problems(self) -> tuple[dict[int, StageProblem], dict[int, int]]:
        """The stage's problem at every bucket edge of its lengths, each from
        its layers measured at that length, and the engine's bytes for one
        micro-batch of that length. What the measuring step showed beyond the
        model (the backward's workspace, the loss phase) was seen at the
        measured length: at a longer one it is counted as growing with the
        square of the length (no faster than eager attention's scores), at a
        shorter one as it was."""
        if self._length_measurements is None:  # measured once; a plan made again reuses them
            lengths = sorted({*self.lengths.edges, self.measured_length})
            self._length_measurements = {length: self._measure_length(length) for length in lengths}
            self._measured_sample = None
        engine = {length: measured.engine_bytes for length, measured in self._length_measurements.items()}
        problems = {}
        for length in self.lengths.edges:
            measured = self._length_measurements[length]
            problem = self._problem(measured.meters, engine[length])
            boundary, margin, workspace = self._unmodelled_growth(length, problem)
            # The loss phase (last stage): what the measuring step showed there,
            # grown as the measured passes' loss phases grew (where not measured:
            # with the length, a loss over the tokens), less what the base counts of it.
            start = max(0, self._measured_start_extra_bytes + self._loss_phase_growth(length)
                        - (self._measured_rebuild_extra_bytes + workspace)
                        - (self._measured_boundary_bytes + boundary))
            problems[length] = dataclasses.replace(problem, base_bytes=problem.base_bytes + boundary + margin
                                                   + workspace + self._dynamic_buffer_bytes(engine),
                                                   backward_start_bytes=start)
        return problems, {length: engine[length] for length in self.lengths.edges}

    def _dynamic_buffer_bytes(self, engine: dict[int, int]) -> int:
        """With dynamic shapes DeepSpeed's engine allocates its buffers anew as
        shapes change: its pipeline buffer slots (``max(2, k)`` stage inputs,
        kept until the slot is reused, and on the last stage its outputs, the
        logits, which its backward does not free), the receive buffer and the
        gradient buffer, each up to the longest micro-batch, and briefly two of
        one while it replaces it. What the measuring step showed of them at
        its length is in the base; this is the rest, up to the longest length."""
        slots = max(2, self.in_flight) + 2
        longest, measured = self.lengths.max_length, self.measured_length
        grown = engine[longest] - engine[measured]
        if self.stage == self.num_stages - 1:
            grown += (self._length_measurements[longest].output_bytes
                      - self._length_measurements[measured].output_bytes)
        return slots * max(0, grown)

    def _loss_phase_growth(self, length: int) -> int:
        """How much more the loss phase holds at ``length`` than at the measured length."""
        measured = self._length_measurements[self.measured_length].loss_phase_bytes
        at_length = self._length_measurements[length].loss_phase_bytes
        if measured is not None and at_length is not None:
            return max(0, at_length - measured)
        return max(0, math.ceil(self._measured_start_extra_bytes * (self._ratio(length) - 1)))

    def _ratio(self, length: int) -> float:
        return length / self.measured_length

    def _unmodelled_growth(self, length: int, problem: StageProblem) -> tuple[int, int, int]:
        """How much what the measured steps showed beyond the model, counted
        at the measured length, grows by at ``length``, in parts: the
        activation gradient in flight (the largest layer boundary at that
        length), the small allocations' margin (with the length), and the
        backward's workspace as the stage's measured passes at both lengths
        differ (where someone else profiled them: as the square of the
        length, no faster than eager attention's scores). Never below 0."""
        measured = self._length_measurements[self.measured_length]
        at_length = self._length_measurements[length]
        boundary = self._largest_boundary_bytes(problem) - self._measured_boundary_bytes
        margin = self._measured_margin_bytes * (self._ratio(length) - 1)
        if at_length.workspace_bytes is not None and measured.workspace_bytes is not None:
            workspace = at_length.workspace_bytes - measured.workspace_bytes
        else:
            workspace = self._measured_rebuild_extra_bytes * (self._ratio(length) ** 2 - 1)
        return max(0, boundary), max(0, math.ceil(margin)), max(0, math.ceil(workspace))

    def _largest_boundary_bytes(self, problem: StageProblem) -> int:
        """The largest tensor that crosses a layer boundary inside this stage
        (its input, a layer's input): the size of an activation gradient in
        flight between segments. (The gradient of the stage's output comes
        with the loss or from the next stage, at the backward's start, which
        the measuring step's first phase shows.)"""
        return max([self.measurement.stage_input_bytes] + [layer.input_bytes for layer in problem.layers])

    def floor(self, problem: StageProblem, minimum_bytes: int, engine_bytes: int | None = None,
              unmodelled_bytes: int | None = None) -> str:
        """What the least feasible peak ``minimum_bytes`` is made of: the part
        the plan controls (the activations it keeps) and the part it does not,
        with the known big non-activation buffers named (``engine_bytes`` and
        ``unmodelled_bytes``: those parts of the problem's base, when not the
        measuring step's)."""
        engine = self._base_bytes() if engine_bytes is None else engine_bytes
        unmodelled = self.unmodelled_bytes if unmodelled_bytes is None else unmodelled_bytes
        gradients = max(0, problem.base_bytes - engine - unmodelled)
        held = "inputs" if self.stage == self.num_stages - 1 else "inputs and outputs"
        parts = [f"{engine / MIB:.2f} MiB the engine's stage {held} ({self.in_flight} micro-batch(es) in flight, "
                 "and their gradients)"]
        if gradients:
            parts.append(f"{gradients / MIB:.2f} MiB parameter gradients")
        if unmodelled:
            known = "".join(f"; of it, {buffer.description}: {buffer.bytes / MIB:.2f} MiB"
                            + (f" ({buffer.fix})" if buffer.fix else "")
                            for buffer in self.known_buffers if buffer.bytes)
            parts.append(f"{unmodelled / MIB:.2f} MiB that the measured steps showed beyond the "
                         f"layers' activations (the backward's workspace, the engine's and the optimizer's buffers"
                         f"{known})")
        start = (f" The end of the forwards also holds {problem.backward_start_bytes / MIB:.2f} MiB beyond the "
                 "activations (the loss, the gradient of the stage's output), counted with them."
                 if problem.backward_start_bytes else "")
        return (f"Of that, {(minimum_bytes - problem.base_bytes) / MIB:.2f} MiB is what the plan controls (the "
                f"activations it keeps) and {problem.base_bytes / MIB:.2f} MiB is not: {', '.join(parts)}.{start}")

    def _first_rank_of_stage(self) -> bool:
        grid = getattr(self.module, "_grid", None)
        if grid is None or not dist.is_initialized():
            return True
        return grid.get_data_parallel_rank() == 0 and grid.get_slice_parallel_rank() == 0

    def _announce(self) -> None:
        if self._first_rank_of_stage():
            print(self.planned.table(), flush=True)

    def _finish_tracking(self) -> None:
        self._step_end_hook.remove()
        self._tracking.__exit__(None, None, None)
        report = self._tracker.report
        measured = report.peak_bytes
        self._tracker_start_bytes = report.start_bytes
        self._tracking = self._tracker = None
        if self._first_step:
            # What the first step keeps allocated (the optimizer's state, gradients that
            # outlive steps, the engine's buffers) is allocated once, in it: no plan
            # controls it, and later steps begin with it (see PlannedStage.first_step_*).
            self._first_step = False
            self.first_step_peak_bytes, self.first_step_kept_bytes = measured, max(0, report.final_bytes)
            return
        if self._measuring_step:
            self._measuring_step = False
            self.measuring_step_peak_bytes = measured
            self.loss_phase_peak_bytes = report.interval_peaks.get(BACKWARD_BEGINS)
            self.step_start_bytes = self._tracker_start_bytes
            return
        planned = self.planned
        planned.measured_peak_bytes = measured
        predicted = planned.predicted_peak_bytes
        # The prediction must be an upper bound: a step above it, or above the
        # budget, is planned again. One well below it is only wasteful.
        under = measured > predicted
        over = measured > self.budget_bytes
        calibrate = (under or over) and self.calibrations < MAX_CALIBRATIONS
        if under or over:
            action = ("Planning again at the next step's start with the difference counted as memory the model "
                      "does not see; the new plan is checked in that step." if calibrate else "The plan stands.")
            warnings.warn(PlanPredictionWarning(
                f"ds_pipe_ckpt: pipeline stage {self.stage}'s checkpointing plan predicted a peak of "
                f"{predicted / MIB:.2f} MiB above the step's start; the step measured {measured / MIB:.2f} MiB "
                f"({(predicted - measured) / measured:+.0%}) against a budget of {self.budget_bytes / MIB:.2f} MiB. "
                f"{action} The memory model (what each layer saves, measured on one micro-batch, plus what the "
                "measuring step showed beyond it) misses some of this stage's memory, e.g. buffers that "
                "differ with the plan or between steps, or, with micro-batches of variable length, what the "
                "passes measured at each length could not show."), stacklevel=2)
        if calibrate:
            self.calibrations += 1
            self.unmodelled_bytes += measured - predicted
            self._advance(StageEvent.CHECK_MISSED)
        else:
            self._advance(StageEvent.CHECK_HELD)
