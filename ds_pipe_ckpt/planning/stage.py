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
   budget that fits.
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
from .cost_model import Decision, LayerProfile, StageProblem
from .profile import LayerMeter, StorageLedger, tensor_bytes
from .report import plan_table
from .solver import InfeasibleBudgetError, StagePlan, plan_stage

__all__ = ["StagePlanner", "PlannedStage", "PlanPredictionWarning", "PREDICTION_TOLERANCE"]

PREDICTION_TOLERANCE = 0.10
MIB = 2**20
MEASURED_FORWARD = 2  # which training forward is measured (counted from 1)
MAX_CALIBRATIONS = 2  # plans made again after a measured step that did not fit the prediction


class PlanPredictionWarning(UserWarning):
    """A stage's measured peak memory differs from its plan's prediction by
    more than :data:`PREDICTION_TOLERANCE`."""


@dataclass
class PlannedStage:
    """One stage's plan, as ``PipelineModule.checkpoint_plan`` exposes it."""

    stage: int
    num_stages: int
    in_flight: int
    budget_bytes: int
    problem: StageProblem
    plan: StagePlan
    measured_peak_bytes: int | None = None
    # (predicted, measured) peak of each earlier plan of this stage whose measured
    # step did not fit its prediction (this plan was made after them).
    earlier_checks: tuple[tuple[int, int], ...] = ()

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.problem.layers]

    def decisions(self) -> list[Decision]:
        """The decision for each local layer, in order."""
        return [self.plan.decision_of(i) for i in range(len(self.problem.layers))]

    def table(self) -> str:
        """The plan as a markdown table, with its totals."""
        return plan_table(self)


@dataclass
class _Measurement:
    """The first micro-batch's meters, and what the base is made of."""

    meters: list[LayerMeter]
    stage_input_bytes: int
    stage_output_bytes: int = 0

    @property
    def complete(self) -> bool:
        return all(meter.complete for meter in self.meters)


class StagePlanner:
    """Runs one stage's forward as measured, then as planned (module docstring)."""

    def __init__(self, module: Any, *, budget_bytes: int, micro_batches: int):
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.module = module
        self.budget_bytes = budget_bytes
        self.micro_batches = micro_batches
        self.stage, self.num_stages = module.stage_id, module.num_stages
        self.in_flight = min(self.num_stages - self.stage, micro_batches)
        self.forwards = 0  # training (grad-enabled) forwards so far
        self.measurement: _Measurement | None = None
        self.planned: PlannedStage | None = None
        self._tracking: Any = None  # the memory tracking context of the checked step
        self._tracker: memory.MemoryTracker | None = None
        self._step_end_hook: Any = None
        self._checked = False
        self._replan_from: PlannedStage | None = None  # a checked plan to make again at the next step's start
        self._step_begun = False  # module.train() began the step before its first forward
        self.calibrations = 0
        self.unmodelled_bytes = 0  # what measured steps showed beyond the model (may be negative)
        self.device = next((p.device for p in module.parameters()), torch.device("cpu"))
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
        measure = self.measurement is None and self.forwards == MEASURED_FORWARD
        if measure:
            inputs = x if isinstance(x, tuple) else (x, )
            # Held whatever the plan: the stage input, and the parameters and buffers
            # (a saved ``weight.t()`` is a view of one: it adds nothing).
            held = [t for t in inputs if isinstance(t, torch.Tensor)]
            held += [*module.parameters(), *module.buffers()]
            ledger = StorageLedger(held)
            save_ops = frozenset(self._save_ops())
            meters = [LayerMeter(module.segment_label(i, i + 1), ledger, save_ops, self.device, first_layer=i == 0,
                                 checkpointable=self._checkpointable(i))
                      for i in range(layers)]
            self.measurement = _Measurement(meters, stage_input_bytes=tensor_bytes(inputs))
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
            self.measurement.stage_output_bytes = tensor_bytes(x if isinstance(x, tuple) else (x, ))
        return x

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
            self._finish_check()
        if self._replan_from is not None:
            checked, self._replan_from = self._replan_from, None
            self.planned = self._plan()
            self.planned.earlier_checks = (*checked.earlier_checks,
                                           (checked.plan.predicted_peak_bytes, checked.measured_peak_bytes))
            self._announce()
        if self.planned is None and self.measurement is not None and self.measurement.complete:
            self.planned = self._plan()
            self._announce()
        if self.planned is not None and not self._checked and not torch.autograd._profiler_enabled():
            # Garbage made before the step (reference cycles, which the collector
            # frees at an arbitrary allocation) must not be freed inside the checked
            # step: its size would lower the measured peak. A few steps only.
            gc.collect()
            self._tracking = memory.track_memory(self.device)
            self._tracker = self._tracking.__enter__()
            # The step ends with the optimizer step (DeepSpeed's last instruction).
            self._step_end_hook = register_optimizer_step_post_hook(lambda *_: self._finish_check())

    def _base_bytes(self) -> int:
        """What does not depend on the plan: the engine's copies of the inputs and
        outputs of the micro-batches in flight, plus one incoming and one outgoing
        gradient."""
        measured = self.measurement
        return (self.in_flight + 1) * (measured.stage_input_bytes + measured.stage_output_bytes)

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

    def _plan(self) -> PlannedStage:
        scale = self._input_scale()
        layers: tuple[LayerProfile, ...] = tuple(
            dataclasses.replace(meter.profile(scale), grad_bytes=grads)
            for meter, grads in zip(self.measurement.meters, self._gradient_bytes_by_layer()))
        # With more micro-batches than in flight, the stage's later forwards and
        # backwards (1F1B's steady state) run with every gradient allocated and
        # k - 1 other micro-batches held: the gradients are as good as base then.
        # Otherwise each backward allocates them as it goes (LayerProfile.grad_bytes).
        base = self._base_bytes()
        if self.micro_batches > self.in_flight:
            base += sum(layer.grad_bytes for layer in layers)
            layers = tuple(dataclasses.replace(layer, grad_bytes=0) for layer in layers)
        problem = StageProblem(layers=layers, in_flight=self.in_flight, budget_bytes=self.budget_bytes,
                               base_bytes=max(0, base + self.unmodelled_bytes), label=f"pipeline stage {self.stage}")
        try:
            plan = plan_stage(problem)
        except InfeasibleBudgetError as error:
            raise ConfigError(
                "activation_checkpointing.memory_budget_mb", round(self.budget_bytes / MIB, 3),
                f"at least {error.minimum_bytes / MIB:.2f} MiB for pipeline stage {self.stage}",
                f"No plan keeps this stage's predicted peak within the budget ({self.in_flight} micro-batch(es) "
                f"in flight; measured on its first micro-batch); {error.minimum_bytes / MIB:.2f} MiB is the "
                "smallest that fits. Raise the budget, lower the micro-batch size, or use more stages.") from error
        return PlannedStage(stage=self.stage, num_stages=self.num_stages, in_flight=self.in_flight,
                            budget_bytes=self.budget_bytes, problem=problem, plan=plan)

    def _first_rank_of_stage(self) -> bool:
        grid = getattr(self.module, "_grid", None)
        if grid is None or not dist.is_initialized():
            return True
        return grid.get_data_parallel_rank() == 0 and grid.get_slice_parallel_rank() == 0

    def _announce(self) -> None:
        if self._first_rank_of_stage():
            print(self.planned.table(), flush=True)

    def _finish_check(self) -> None:
        self._step_end_hook.remove()
        self._tracking.__exit__(None, None, None)
        measured = self._tracker.report.peak_bytes
        self._tracking = self._tracker = None
        self._checked = True
        planned = self.planned
        planned.measured_peak_bytes = measured
        predicted = planned.plan.predicted_peak_bytes
        off = measured > 0 and abs(predicted - measured) > PREDICTION_TOLERANCE * measured
        over = measured > self.budget_bytes
        calibrate = (off or over) and self.calibrations < MAX_CALIBRATIONS
        if off or over:
            action = ("Planning again at the next step's start with the difference counted as memory the model "
                      "does not see; the new plan is checked in that step." if calibrate else "The plan stands.")
            warnings.warn(PlanPredictionWarning(
                f"ds_pipe_ckpt: pipeline stage {self.stage}'s checkpointing plan predicted a peak of "
                f"{predicted / MIB:.2f} MiB above the step's start; the step measured {measured / MIB:.2f} MiB "
                f"({(predicted - measured) / measured:+.0%}) against a budget of {self.budget_bytes / MIB:.2f} MiB. "
                f"{action} The memory model (what each layer saves, measured on one micro-batch) misses some of "
                "this stage's memory, e.g. buffers inside a layer's backward or of the engine, or shapes that "
                "vary between micro-batches."), stacklevel=2)
        if calibrate:
            self.calibrations += 1
            self.unmodelled_bytes += measured - predicted
            self._replan_from = planned
            self._checked = False
