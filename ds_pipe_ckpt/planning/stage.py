"""The planner at work inside one pipeline stage's ``PipelineModule.forward``:
when to measure, plan, follow the plan and check it. It delegates the rest,
one module per job: running and measuring the layers (:mod:`.stage_measurement`),
variable lengths (:mod:`.stage_lengths`), the problem (:mod:`.stage_problem`),
the solvers, the budget and the verdict on a checked step
(:mod:`.stage_budget`), tracking a step's memory (:mod:`.step_tracking`) and the
phase (:mod:`.stage_phase`).

Life of a :class:`StagePlanner` (``activation_checkpointing.memory_budget_mb``
set; ``ds_pipe_ckpt.initialize`` creates it through ``PipelineModule.enable_planning``):

1. **Until planned: measure.** Every local layer runs as its own checkpointed
   region (the memory-safe choice while nothing is known). On the second
   training micro-batch (the first warms up: lazy initialisation and first-call
   allocations would inflate its times) each region carries a
   :class:`~.profile.LayerMeter`, and its recomputation runs to the end so that
   every op is seen; the whole second step (the measuring step) is tracked.
2. **The next step's start: plan.** The measurements, the micro-batches this
   stage keeps in flight under DeepSpeed's 1F1B ``TrainSchedule``
   (``min(stages - stage, micro_batches)``) and the budget go to the exact
   solver. The plan is printed (one table per stage, on the stage's first rank),
   exposed as ``PipelineModule.checkpoint_plan``, and followed from this step on.
   A budget no plan fits raises :class:`~ds_pipe_ckpt.ConfigError` naming the
   smallest budget that fits, on every rank of the job at once (the planning is
   agreed at each step start where a stage may plan, :mod:`.agreement`).
3. **The first planned step: check.** Its peak memory (bytes above the step's
   start, by :mod:`ds_pipe_ckpt.memory`) is compared with the prediction, which
   must be an upper bound (:class:`~.stage_budget.StepCheck`). The step starts
   where DeepSpeed's ``train_batch()`` calls ``module.train()`` (or at its first
   forward where nothing calls it) and ends with the optimizer step. A measured
   peak above the prediction or the budget is a :class:`PlanPredictionWarning`
   naming the stage, and the stage plans again at the next step's start with the
   difference counted as memory the model does not see, and checks that plan (at
   most twice). With variable lengths a step is predicted by the bucket of its
   longest micro-batch (``LengthPlans.bound_up_to``), and the checks go on, one
   step per bucket at most, until each bucket has been a checked step's longest
   (``PlannedStage.measured_by_length``). A step someone else profiles is left alone.
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from .. import memory
from ..errors import ConfigError
from ..selective import ops_to_keep
from ..settings import current_settings
from .agreement import agree
from .length_plans import plan_lengths
from .minimum_budget import InfeasibleBudgetError
from .plan import Decision
from .planned import PlannedStage
from .problem import StageProblem
from .profile import LayerMeter, tensor_bytes
from .shapes import SequenceLengths
from .solver import plan_stage
from .stage_budget import StepCheck, auto_max_memory_bytes, budget_from_max_memory, no_plan_fits
from .stage_lengths import StageLengths
from .stage_measurement import BACKWARD_BEGINS, FORWARD_ENDS, StageMeasurement, StageMeasurer
from .stage_phase import StageEvent, StagePhase, next_phase
from .stage_problem import (KnownBuffer, LengthFigures, StageFacts, Unmodelled, floor_text, length_problems,
                            measuring_step_model_bytes, stage_problem, unmodelled_from_measuring_step,
                            unmodelled_growth)
from .step_tracking import StepMemory, TrackedStep

__all__ = ["StagePlanner", "PlanPredictionWarning"]

class PlanPredictionWarning(UserWarning):
    """A stage's measured peak memory was above its plan's prediction, or
    above the budget; or a stage could not be measured (and stays unplanned)."""


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
        self.measurement: StageMeasurement | None = None
        self.planned: PlannedStage | None = None
        self._tracked: StepMemory | None = None  # the step being tracked, if any
        self._step_longest_edge: int | None = None  # with lengths: the bucket of this step's longest micro-batch
        self.phase = StagePhase.MEASURING  # planning.stage_phase; moved only by _advance
        # Whether this step start's planning is agreed with every rank (planning.agreement):
        # from the step after the measuring step, while any rank may still plan.
        self._agreement_due = False
        self._step_begun = False  # module.train() began the step before its first forward
        # The first step's peak and what it left allocated (None: not measured).
        self.first_step_peak_bytes: int | None = None
        self.first_step_kept_bytes: int | None = None
        self.measuring_step_peak_bytes: int | None = None  # the whole measuring step's peak
        # The last stage: the measuring step's peak from the measured micro-batch's forward end to
        # its first recomputation (the loss, its backward, the layers stored anyway); None: not seen
        self.loss_phase_peak_bytes: int | None = None
        self.unmeasured: list[str] = []  # layers the measuring step could not measure (then no plan)
        self.calibrations = 0
        self.length_checks = 0  # checked planned steps, with variable lengths
        self.unmodelled_bytes = 0  # what measured steps showed beyond the model (>= 0)
        self.unmodelled = Unmodelled()  # what the measuring step showed of it, in parts (set by the first plan)
        # Variable-length micro-batches (dynamic_shape=True), when planned for.
        self.lengths = None if lengths is None else StageLengths(lengths, self.stage,
                                                                   self.stage == self.num_stages - 1)
        self.planning_s = 0.0  # the planner's own time (measuring every length, solving), over the run
        self.device = next((p.device for p in module.parameters()), torch.device("cpu"))
        if max_memory_bytes == "auto":
            capacity = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else 0
            self.max_memory_bytes = auto_max_memory_bytes(self.budget_key, self.stage, self.device.type, capacity)
        self.measurer = StageMeasurer(module, self.device, self._options, self._save_ops)
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
            in_measuring_step = self.planned is None and self.micro_batches <= self.forwards < 2 * self.micro_batches
            edge = self.lengths.edge_of(x, module.micro_offset, in_measuring_step=in_measuring_step)
            self._step_longest_edge = max(edge, self._step_longest_edge or 0)
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
        # The first micro-batch of the second step: the first step warms up (lazy
        # initialisation, first-call allocations, the engine's and the optimizer's
        # buffers), and the whole second step is tracked (see _step_begins).
        measure = self.measurement is None and self.forwards == self.micro_batches + 1
        if measure:
            inputs = x if isinstance(x, tuple) else (x, )
            meters = self.measurer.new_meters(inputs, before_recomputation=self._backward_begins,
                                              marker=functools.partial(self._mark_once, every_stage=True))
            self.measurement = StageMeasurement(meters, stage_input_bytes=tensor_bytes(inputs))
            if self.lengths is not None:
                self.lengths.keep_measured(inputs, isinstance(x, tuple))
            self._agreement_due = True  # every stage measures in the same step, and plans at the next one's start
            # Recomputations run to the end, so that the meters see every op.
            options = self._options("full", early_stop=False)
        else:
            options = self._options("full")
        x = self.measurer.run_per_layer(x, seed_offset, options, self.measurement.meters if measure else None)
        if measure:
            self._mark_once(FORWARD_ENDS)
            outputs = x if isinstance(x, tuple) else (x, )
            self.measurement.stage_output_bytes = tensor_bytes(outputs)
            self.measurement.stage_float_outputs = sum(isinstance(t, torch.Tensor) and t.is_floating_point()
                                                       for t in outputs)
        return x

    def observed_loss(self, loss_fn: Any) -> Any:
        """``module.loss_fn`` as the engine calls it: the loss itself, or, for the
        measured micro-batch's loss on the last stage with variable lengths,
        the loss that keeps its labels, with which every length's measured
        pass runs the loss too."""
        if self.lengths is not None and self.forwards == self.micro_batches + 1:
            return self.lengths.labels_keeper(loss_fn) or loss_fn
        return loss_fn

    def _mark_once(self, name: str, every_stage: bool = False) -> None:
        """During the measuring step, on the last stage (on every stage with
        ``every_stage``: a layer's forward begins or ends): mark ``name`` (once)."""
        tracked = self._tracked
        if ((every_stage or self.stage == self.num_stages - 1) and tracked is not None
                and tracked.kind is TrackedStep.MEASURING):
            tracked.mark_once(name)

    def _backward_begins(self) -> None:
        """The measured micro-batch's first recomputation is about to run."""
        if self._tracked is not None and self._tracked.marked(FORWARD_ENDS):
            self._mark_once(BACKWARD_BEGINS)

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
        if self._tracked is not None:
            self._finish_tracking()
        self._step_longest_edge = None
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
        kind = self._step_to_track()
        if kind is not None and not torch.autograd._profiler_enabled():
            self._tracked = StepMemory(kind, self.device, on_end=self._finish_tracking)

    def _step_to_track(self) -> TrackedStep | None:
        """What the step now beginning is tracked for, if it is."""
        if self.forwards == 0:
            return TrackedStep.FIRST
        if self.measurement is None and self.forwards == self.micro_batches:
            return TrackedStep.MEASURING
        if self.phase in (StagePhase.CHECKING, StagePhase.REPLAN_DUE):
            return TrackedStep.CHECK
        return None

    def _plan_if_due(self) -> None:
        """Plan again after a checked step that did not fit its prediction, or
        for the first time after the measuring step."""
        if self.phase is StagePhase.REPLAN_DUE:
            checked = self.planned
            self._advance(StageEvent.REPLANNING)
            self.planned = self._plan()
            self.planned.earlier_checks = (*checked.earlier_checks, checked.last_check)
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

    def _facts(self) -> StageFacts:
        measured = self.measurement
        return StageFacts(stage=self.stage, num_stages=self.num_stages, in_flight=self.in_flight,
                          micro_batches=self.micro_batches, stage_input_bytes=measured.stage_input_bytes,
                          stage_output_bytes=measured.stage_output_bytes,
                          backward_keeps_graph=measured.backward_keeps_graph(self.stage == self.num_stages - 1))

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
        """The solver's problem for this stage (:func:`~.stage_problem.stage_problem`),
        with the memory measured steps showed beyond the model counted in its
        base. By default from the measuring step; else from ``meters``, with
        ``engine_bytes`` the engine's copies of one micro-batch's stage input and output."""
        scale = self._input_scale()
        return stage_problem(self._facts(), [meter.profile(scale) for meter in meters or self.measurement.meters],
                             self.measurer.gradient_bytes_by_layer(), budget_bytes=self.budget_bytes,
                             unmodelled_bytes=self.unmodelled_bytes,
                             backward_start_bytes=self.unmodelled.backward_start_bytes,
                             engine_bytes_per_micro_batch=engine_bytes,
                             backward_only_bytes=self.unmodelled.boundary_bytes)

    def _resolve_budget(self) -> None:
        """With max_memory_bytes: the budget is what the measuring step began with, taken from it."""
        if self.budget_bytes is None:
            self.budget_bytes = budget_from_max_memory(self.budget_key, self.max_memory_bytes, self.step_start_bytes,
                                                       self.stage)

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
        if self.measuring_step_peak_bytes is not None and self.planned is None and not self.calibrations:
            # Counted from the first plan on, so that the prediction is an upper bound.
            self.unmodelled = self._unmodelled_from_measuring_step()
            self.unmodelled_bytes = self.unmodelled.base_bytes
        problem = self._problem()
        length_plans = engine_bytes = unmodelled = None
        if self.lengths is not None:
            figures = self._length_figures()
            problems = length_problems(self._facts(), self.unmodelled, figures, self.lengths.edges,
                                       self.lengths.measured_length,
                                       max(self.lengths.measuring_step_lengths, default=None))
            engine_by_length = {length: figures[length].engine_bytes for length in self.lengths.edges}
            longest, measured = self.lengths.max_length, self.lengths.measured_length
            problem = problems[longest]
            engine_bytes = (self.in_flight + 1) * engine_by_length[longest]
            unmodelled = self.unmodelled_bytes + sum(unmodelled_growth(
                self._facts(), self.unmodelled, figures[measured], figures[longest], longest / measured))
        # Of the base: the engine's buffers, and what the measured steps showed beyond the layers.
        split = (self._facts().engine_base_bytes() if engine_bytes is None else engine_bytes,
                 self.unmodelled_bytes if unmodelled is None else unmodelled)
        try:
            if self.lengths is not None:
                length_plans = plan_lengths(problems, engine_by_length)
                plan = length_plans.longest.plan
            else:
                plan = plan_stage(problem)
        except InfeasibleBudgetError as error:
            raise self._no_plan_fits(error, problem, *split) from error
        return PlannedStage(stage=self.stage, num_stages=self.num_stages, in_flight=self.in_flight, base_split=split,
                            budget_bytes=self.budget_bytes, problem=problem, plan=plan,
                            step_start_bytes=self.step_start_bytes if self.max_memory_bytes is not None else None,
                            measuring_step_peak_bytes=self.measuring_step_peak_bytes, lengths=length_plans,
                            first_step_peak_bytes=self.first_step_peak_bytes,
                            first_step_kept_bytes=self.first_step_kept_bytes,
                            measured_length=None if self.lengths is None else self.lengths.measured_length)

    def _unmodelled_from_measuring_step(self) -> Unmodelled:
        """What the measuring step showed beyond the model of the plan it ran
        (:func:`~.stage_problem.unmodelled_from_measuring_step`), its
        micro-batches modelled at the lengths they had."""
        modelled = None
        if self.lengths is not None and self.lengths.measuring_step_lengths:
            figures = self._length_figures()  # nothing unmodelled counted yet
            step = [figures[length] for length in self.lengths.measuring_step_lengths]
            modelled = measuring_step_model_bytes(self._facts(), step, self.measurer.gradient_bytes_by_layer())
        return unmodelled_from_measuring_step(self._facts(), self._problem(), self.measuring_step_peak_bytes,
                                              self.loss_phase_peak_bytes, modelled)

    def _no_plan_fits(self, error: InfeasibleBudgetError, problem: StageProblem, engine_bytes: int,
                      unmodelled_bytes: int) -> ConfigError:
        return no_plan_fits(self.budget_key, stage=self.stage, in_flight=self.in_flight, budget_bytes=self.budget_bytes,
                            minimum_bytes=error.minimum_bytes,
                            step_start_bytes=self.step_start_bytes if self.max_memory_bytes is not None else 0,
                            floor=self.floor(problem, error.minimum_bytes, engine_bytes, unmodelled_bytes),
                            max_sequence_length=self.lengths.max_length if self.lengths is not None else None)

    def _length_figures(self) -> dict[int, LengthFigures]:
        """Every measured length's figures, its problem built as the measuring step's is."""
        measurements = self.lengths.measurements(self.measurer, self._input_scale())
        return {length: LengthFigures(self._problem(measured.meters, measured.engine_bytes), measured.engine_bytes, measured.workspace_bytes,
                                      measured.loss_phase_bytes, measured.output_bytes)
                for length, measured in measurements.items()}

    def floor(self, problem: StageProblem, minimum_bytes: int, engine_bytes: int, unmodelled_bytes: int) -> str:
        """What the least feasible peak ``minimum_bytes`` is made of
        (:func:`~.stage_problem.floor_text`; ``engine_bytes`` and
        ``unmodelled_bytes``: those parts of the problem's base)."""
        return floor_text(self._facts(), problem, minimum_bytes, engine_bytes=engine_bytes,
                          unmodelled_bytes=unmodelled_bytes, known_buffers=self.known_buffers)

    def _first_rank_of_stage(self) -> bool:
        grid = getattr(self.module, "_grid", None)
        if grid is None or not dist.is_initialized():
            return True
        return grid.get_data_parallel_rank() == 0 and grid.get_slice_parallel_rank() == 0

    def _announce(self) -> None:
        if self._first_rank_of_stage():
            print(self.planned.table(), flush=True)

    def _finish_tracking(self) -> None:
        tracked, self._tracked = self._tracked, None
        report = tracked.finish()
        measured = report.peak_bytes
        if tracked.kind is TrackedStep.FIRST:
            # What the first step keeps allocated (the optimizer's state, gradients that
            # outlive steps, the engine's buffers) is allocated once, in it: no plan
            # controls it, and later steps begin with it (see PlannedStage.first_step_*).
            self.first_step_peak_bytes, self.first_step_kept_bytes = measured, max(0, report.final_bytes)
            return
        if tracked.kind is TrackedStep.MEASURING:
            self.measuring_step_peak_bytes = measured
            self.loss_phase_peak_bytes = report.interval_peaks.get(BACKWARD_BEGINS)
            for meter in self.measurement.meters if self.measurement is not None else ():
                meter.read_forward_peak(report.marks, report.interval_peaks)
            self.step_start_bytes = report.start_bytes
            return
        planned, edge = self.planned, self._step_longest_edge
        self.length_checks += edge is not None
        predicted = planned.predicted_for(edge)
        planned.record_check(edge, predicted, measured)
        check = StepCheck(self.stage, predicted, measured, self.budget_bytes, self.calibrations)
        if check.missed:
            warnings.warn(PlanPredictionWarning(check.warning()), stacklevel=2)
        if check.calibrates:
            self.calibrations += 1
            self.unmodelled_bytes += check.unseen_bytes
            self._advance(StageEvent.CHECK_MISSED)
        elif planned.unseen_edges and self.length_checks < len(self.lengths.edges):
            # Until each bucket has been a checked step's longest: over the run, one step per bucket at most.
            self._advance(StageEvent.LENGTH_CHECK_HELD)
        else:
            self._advance(StageEvent.CHECK_HELD)
