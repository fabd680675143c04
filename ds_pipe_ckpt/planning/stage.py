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
   steps). A prediction off by more than 10%, or a measured peak above the
   budget, is a :class:`PlanPredictionWarning` naming the stage; the stage
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
from .profile import LayerMeter, StorageLedger, tensor_bytes
from .agreement import agree
from .planned import PlannedStage
from .solver import InfeasibleBudgetError, plan_stage

__all__ = ["StagePlanner", "PlannedStage", "PlanPredictionWarning", "KnownBuffer", "PREDICTION_TOLERANCE"]

PREDICTION_TOLERANCE = 0.10
# The measuring step's marks on the last stage: its loss phase runs from the end of
# the measured micro-batch's forward to that micro-batch's first recomputation.
FORWARD_ENDS = "ds_pipe_ckpt: forward end"
BACKWARD_BEGINS = "ds_pipe_ckpt: first recomputation"
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
                 known_buffers: tuple[KnownBuffer, ...] = (), max_memory_bytes: int | str | None = None):
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
        self._checked = False
        self._replan_from: PlannedStage | None = None  # a checked plan to make again at the next step's start
        # Whether this step start's planning is agreed with every rank (planning.agreement):
        # from the step after the measuring step, while any rank may still plan.
        self._agreement_due = False
        self._step_begun = False  # module.train() began the step before its first forward
        self._measuring_step = False  # the tracked step is the measuring step, not a planned one
        self.measuring_step_peak_bytes: int | None = None  # the whole measuring step's peak
        # The last stage: the measuring step's peak from the measured micro-batch's forward
        # end to its first recomputation (the loss, its backward, the layers stored anyway),
        # None where that was not seen
        self.loss_phase_peak_bytes: int | None = None
        self.backward_start_extra_bytes = 0  # what that phase showed beyond the model's k * H
        self.unmeasured: list[str] = []  # layers the measuring step could not measure (then no plan)
        self.calibrations = 0
        self.unmodelled_bytes = 0  # what measured steps showed beyond the model (>= 0)
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
        self.forwards += 1
        if self.planned is None:
            return self._forward_per_layer(x, seed_offset)
        for segment in self.planned.plan.segments:
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
            # Held whatever the plan: the stage input, and the parameters and buffers
            # (a saved ``weight.t()`` is a view of one: it adds nothing).
            held = [t for t in inputs if isinstance(t, torch.Tensor)]
            held += [*module.parameters(), *module.buffers()]
            ledger = StorageLedger(held)
            save_ops = frozenset(self._save_ops())
            meters = [LayerMeter(module.segment_label(i, i + 1), ledger, save_ops, self.device, first_layer=i == 0,
                                 checkpointable=self._checkpointable(i), before_recomputation=self._backward_begins)
                      for i in range(layers)]
            self.measurement = _Measurement(meters, stage_input_bytes=tensor_bytes(inputs))
            self._agreement_due = True  # every stage measures in the same step, and plans at the next one's start
            # Recomputations run to the end, so that the meters see every op.
            options = self._options("full", early_stop=False)
        else:
            options = self._options("full")
        for i in range(layers):
            meter = self.measurement.meters[i] if measure else None
            if not self._checkpointable(i):  # excluded by checkpointable_layers: runs plainly, always
                x = self._run_plain(x, i, seed_offset, meter)
                continue
            x = module.run_segment(x, i, i + 1, seed_offset, checkpointed=True, options=options, observer=meter)
        if measure:
            self._mark_once(FORWARD_ENDS)
            outputs = x if isinstance(x, tuple) else (x, )
            self.measurement.stage_output_bytes = tensor_bytes(outputs)
            self.measurement.stage_float_outputs = sum(isinstance(t, torch.Tensor) and t.is_floating_point()
                                                       for t in outputs)
        return x

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
            may_plan_again = self.planned is not None and not self._checked and error is None
            self._agreement_due = agree(self.stage, error, may_plan_again)
        measuring = self.measurement is None and self.forwards == self.micro_batches
        if (measuring or (self.planned is not None and not self._checked)) and not torch.autograd._profiler_enabled():
            # Garbage made before the step (reference cycles, which the collector
            # frees at an arbitrary allocation) must not be freed inside the tracked
            # step: its size would lower the measured peak. A few steps only.
            gc.collect()
            self._measuring_step = measuring
            self._tracking = memory.track_memory(self.device)
            self._tracker = self._tracking.__enter__()
            # The step ends with the optimizer step (DeepSpeed's last instruction).
            self._step_end_hook = register_optimizer_step_post_hook(lambda *_: self._finish_tracking())

    def _plan_if_due(self) -> None:
        """Plan again after a checked step that did not fit its prediction, or
        for the first time after the measuring step."""
        if self._replan_from is not None:
            checked, self._replan_from = self._replan_from, None
            self.planned = self._plan()
            self.planned.earlier_checks = (*checked.earlier_checks,
                                           (checked.plan.predicted_peak_bytes, checked.measured_peak_bytes))
            self._announce()
        if self.planned is None and self.measurement is not None and not self.unmeasured:
            if self.measurement.complete:
                self.planned = self._plan()
                self._announce()
            else:
                self._refuse_incomplete_measurement()

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
            # A module, or a TiedLayerSpec's forward_fn bound to its module.
            modules = [func] if isinstance(func, torch.nn.Module) else \
                [a for a in getattr(func, "args", ()) if isinstance(a, torch.nn.Module)]
            total = 0
            for parameter in (p for module in modules for p in module.parameters()):
                if parameter.requires_grad and parameter.grad is None and id(parameter) not in seen:
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

    def _problem(self) -> StageProblem:
        """The solver's problem for this stage, with the memory measured steps
        showed beyond the model counted in its base."""
        scale = self._input_scale()
        layers: tuple[LayerProfile, ...] = tuple(
            dataclasses.replace(meter.profile(scale), grad_bytes=grads)
            for meter, grads in zip(self.measurement.meters, self._gradient_bytes_by_layer()))
        layers, gradients = gradients_as_base(layers, self.in_flight, self.micro_batches)
        base = self._base_bytes() + gradients
        keeps_graph = self.measurement.backward_keeps_graph(last_stage=self.stage == self.num_stages - 1)
        return StageProblem(layers=layers, in_flight=self.in_flight, budget_bytes=self.budget_bytes,
                            base_bytes=base + self.unmodelled_bytes, label=f"pipeline stage {self.stage}",
                            backward_keeps_graph=keeps_graph, backward_start_bytes=self.backward_start_extra_bytes)

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
            self.backward_start_extra_bytes = max(0, start_extra - rebuild_extra - boundary)
            problem = self._problem()
        try:
            plan = plan_stage(problem)
        except InfeasibleBudgetError as error:
            # In the key's own terms: max_memory_mb counts what a step begins with too.
            start = self.step_start_bytes if self.max_memory_bytes is not None else 0
            configured = self.budget_bytes + start
            smallest = (error.minimum_bytes + start) / MIB
            counted = (f" (with the {start / MIB:.2f} MiB allocated when a step begins: parameters, gradients that "
                       "outlive steps, optimizer state)" if start else "")
            raise ConfigError(
                self.budget_key, round(configured / MIB, 3),
                f"at least {smallest:.2f} MiB for pipeline stage {self.stage}",
                f"No plan keeps this stage's predicted peak within the budget ({self.in_flight} micro-batch(es) "
                f"in flight; measured on its first micro-batches); {smallest:.2f} MiB is the smallest that fits"
                f"{counted}. {self.floor(problem, error.minimum_bytes)} Raise the budget, lower the micro-batch "
                "size, or use more stages.") from error
        return PlannedStage(stage=self.stage, num_stages=self.num_stages, in_flight=self.in_flight,
                            budget_bytes=self.budget_bytes, problem=problem, plan=plan,
                            step_start_bytes=self.step_start_bytes if self.max_memory_bytes is not None else None,
                            measuring_step_peak_bytes=self.measuring_step_peak_bytes)

    def _largest_boundary_bytes(self, problem: StageProblem) -> int:
        """The largest tensor that crosses a layer boundary inside this stage
        (its input, a layer's input): the size of an activation gradient in
        flight between segments. (The gradient of the stage's output comes
        with the loss or from the next stage, at the backward's start, which
        the measuring step's first phase shows.)"""
        return max([self.measurement.stage_input_bytes] + [layer.input_bytes for layer in problem.layers])

    def floor(self, problem: StageProblem, minimum_bytes: int) -> str:
        """What the least feasible peak ``minimum_bytes`` is made of: the part
        the plan controls (the activations it keeps) and the part it does not,
        with the known big non-activation buffers named."""
        engine = self._base_bytes()
        gradients = max(0, problem.base_bytes - engine - self.unmodelled_bytes)
        held = "inputs" if self.stage == self.num_stages - 1 else "inputs and outputs"
        parts = [f"{engine / MIB:.2f} MiB the engine's stage {held} ({self.in_flight} micro-batch(es) in flight, "
                 "and their gradients)"]
        if gradients:
            parts.append(f"{gradients / MIB:.2f} MiB parameter gradients")
        if self.unmodelled_bytes:
            known = "".join(f"; of it, {buffer.description}: {buffer.bytes / MIB:.2f} MiB"
                            + (f" ({buffer.fix})" if buffer.fix else "")
                            for buffer in self.known_buffers if buffer.bytes)
            parts.append(f"{self.unmodelled_bytes / MIB:.2f} MiB that the measured steps showed beyond the "
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
        if self._measuring_step:
            self._measuring_step = False
            self.measuring_step_peak_bytes = measured
            self.loss_phase_peak_bytes = report.interval_peaks.get(BACKWARD_BEGINS)
            self.step_start_bytes = self._tracker_start_bytes
            return
        self._checked = True
        planned = self.planned
        planned.measured_peak_bytes = measured
        predicted = planned.plan.predicted_peak_bytes
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
                "measuring step showed beyond it) misses some of this stage's memory, e.g. shapes that vary "
                "between micro-batches, or buffers that differ with the plan."), stacklevel=2)
        if calibrate:
            self.calibrations += 1
            self.unmodelled_bytes += measured - predicted
            self._replan_from = planned
            self._checked = False
