"""One stage's checkpointing plan, as ``PipelineModule.checkpoint_plan``
exposes it and as the table the planner prints."""

from __future__ import annotations

from dataclasses import dataclass, field

from .cost_model import ChainCosts
from .length_plans import LengthPlan, LengthPlans
from .peak_breakdown import peak_breakdown
from .plan import Decision, StagePlan
from .problem import StageProblem
from .stage_problem import gradient_base_bytes

__all__ = ["PlannedStage", "plan_table"]

MIB = 2**20


@dataclass
class PlannedStage:
    """One stage's plan, as ``PipelineModule.checkpoint_plan`` exposes it."""

    stage: int
    num_stages: int
    in_flight: int
    budget_bytes: int
    problem: StageProblem
    plan: StagePlan
    # The peak of this plan's first checked step (its first planned step), above the step's start.
    measured_peak_bytes: int | None = None
    # Variable lengths: per bucket edge, the highest peak of this plan's checked steps
    # whose longest micro-batch was in that bucket.
    measured_by_length: dict[int, int] = field(default_factory=dict)
    last_check: tuple[int, int] | None = None  # (predicted, measured) peak of the latest of them
    # (predicted, measured) peak of each earlier plan of this stage whose measured
    # step did not fit its prediction (this plan was made after them).
    earlier_checks: tuple[tuple[int, int], ...] = ()
    # With max_memory_mb: what was allocated when the measuring step began; the
    # budget is max_memory_mb less it.
    step_start_bytes: int | None = None
    # The peak of the measuring step (every layer checkpointed) that calibrated the plan.
    measuring_step_peak_bytes: int | None = None
    # Variable-length micro-batches: one plan per length bucket (``plan`` is the
    # longest's), and the length of the measured micro-batch.
    lengths: LengthPlans | None = None
    measured_length: int | None = None
    planning_s: float = 0.0  # the planner's own time so far (measuring every length, solving)
    # The first step (before any plan, every layer checkpointed): its peak above its
    # start, and what it left allocated (allocated once: the optimizer's state,
    # gradients that outlive steps, the engine's buffers), which no plan controls.
    first_step_peak_bytes: int | None = None
    first_step_kept_bytes: int | None = None
    # Of the plan's base (the longest length's): the engine's buffers for the micro-batches in
    # flight, and what the measured steps showed beyond the layers; the rest is parameter gradients.
    base_split: tuple[int, int] | None = None

    @property
    def predicted_peak_bytes(self) -> int:
        """The peak the plan keeps: for variable lengths, that of any mix in flight."""
        return self.plan.predicted_peak_bytes if self.lengths is None else self.lengths.bound_bytes

    def predicted_for(self, edge: int | None) -> int:
        """The peak predicted for a step whose longest micro-batch is in the
        bucket of ``edge`` (None: fixed shapes, or unknown: the whole bound)."""
        if self.lengths is None or edge is None:
            return self.predicted_peak_bytes
        return self.lengths.bound_up_to(edge)

    def record_check(self, edge: int | None, predicted_bytes: int, measured_bytes: int) -> None:
        """A checked step of this plan (longest micro-batch in the bucket of ``edge``) and its figures."""
        if self.measured_peak_bytes is None:
            self.measured_peak_bytes = measured_bytes
        if edge is not None:
            self.measured_by_length[edge] = max(measured_bytes, self.measured_by_length.get(edge, 0))
        self.last_check = (predicted_bytes, measured_bytes)

    @property
    def unseen_edges(self) -> tuple[int, ...]:
        """The bucket edges no checked step of this plan has had as its longest."""
        if self.lengths is None:
            return ()
        return tuple(p.length for p in self.lengths.by_length if p.length not in self.measured_by_length)

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.problem.layers]

    def decisions(self) -> list[Decision]:
        """The decision for each local layer, in order."""
        return [self.plan.decision_of(i) for i in range(len(self.problem.layers))]

    def table(self) -> str:
        """The plan as a markdown table, with its totals."""
        return plan_table(self)


def _layers(names: list[str]) -> str:
    """``pipeline layer 3 (Block)`` and ``pipeline layer 4 (Block)`` as ``layers 3-4 (Block, Block)``."""
    if len(names) == 1:
        return names[0].removeprefix("pipeline ")
    first, last = names[0], names[-1]
    span = f"layers {first.split()[2]}-{last.split()[2]}"
    classes = ", ".join(name.split("(", 1)[1].rstrip(")") for name in names)
    return f"{span} ({classes})"


def plan_table(planned: PlannedStage) -> str:
    """Markdown: one row per segment (layers, decision, MiB held per micro-batch
    in flight, MiB rebuilt during its backward, recomputation ms per micro-batch),
    then the predicted peak against the budget."""
    problem, plan = planned.problem, planned.plan
    chain = ChainCosts(problem)
    lines = [
        f"ds_pipe_ckpt checkpointing plan, pipeline stage {planned.stage} of {planned.num_stages} "
        f"({planned.in_flight} micro-batch(es) in flight):",
        "",
        "| layers | decision | held MiB / micro-batch | rebuilt MiB | recompute ms |",
        "|---|---|---:|---:|---:|",
    ]
    names = planned.layer_names
    for segment in plan.segments:
        cost = chain.cost(segment.start, segment.end, segment.decision)
        lines.append(f"| {_layers(names[segment.start:segment.end])} | {segment.decision.value} "
                     f"| {cost.held_bytes / MIB:.2f} | {cost.transient_bytes / MIB:.2f} "
                     f"| {chain.seconds(cost.recompute_units) * 1e3:.2f} |")
    lines += [
        "",
        f"Predicted peak {plan.predicted_peak_bytes / MIB:.2f} MiB of a {planned.budget_bytes / MIB:.2f} MiB budget "
        f"(of which {problem.base_bytes / MIB:.2f} MiB do not depend on the plan); recomputation "
        f"{plan.recompute_s * 1e3:.2f} ms per micro-batch.",
    ]
    lines.append(_peak_terms(planned))
    if planned.lengths is not None:
        lines += _length_rows(planned)
    if problem.backward_keeps_graph:
        lines.append("The stage's backward keeps each micro-batch's graph to its end (DeepSpeed runs one backward "
                     "per floating-point tensor the stage sends, with retain_graph=True): its stored activations "
                     "are all held while any segment is rebuilt, and the plan counts them so.")
    if planned.step_start_bytes is not None:
        lines.append(f"The budget is max_memory_mb {(planned.budget_bytes + planned.step_start_bytes) / MIB:.2f} MiB "
                     f"less the {planned.step_start_bytes / MIB:.2f} MiB allocated when a step begins (parameters, "
                     "gradients that outlive steps, optimizer state).")
    for predicted, measured in planned.earlier_checks:
        lines.append(f"Planned again: an earlier plan predicted {predicted / MIB:.2f} MiB and its step measured "
                     f"{measured / MIB:.2f} MiB; the difference is counted in the part that does not depend on "
                     "the plan.")
    if planned.first_step_peak_bytes is not None:
        kept = planned.first_step_kept_bytes
        lines.append(f"The first step (no plan yet, every layer checkpointed) peaked at "
                     f"{planned.first_step_peak_bytes / MIB:.2f} MiB above its start, of which {kept / MIB:.2f} MiB "
                     "stayed allocated: memory allocated once, in the first step (the optimizer's state, gradients "
                     "that outlive steps, the engine's buffers), which no plan controls and every later step begins "
                     f"with. Without it: {(planned.first_step_peak_bytes - kept) / MIB:.2f} MiB. memory_budget_mb "
                     "counts from a step's start, so it leaves this out; max_memory_mb counts it.")
    if planned.measured_peak_bytes is not None:
        lines.append(f"Measured peak of this plan's first step: {planned.measured_peak_bytes / MIB:.2f} MiB.")
    return "\n".join(lines)


def _peak_terms(planned: PlannedStage) -> str:
    """Where the predicted peak falls and its terms, the base split into its parts."""
    problem, plan = planned.problem, planned.plan
    terms = peak_breakdown(problem, plan.segments)
    names = "" if terms.segment is None else _layers(planned.layer_names[terms.segment.start:terms.segment.end])
    text = f"The predicted peak falls {terms.describe(names)}"
    if planned.base_split is not None:
        engine, beyond = planned.base_split
        gradients = gradient_base_bytes(problem, engine, beyond)
        text += (f"; the first is {engine / MIB:.2f} MiB the engine's buffers ({planned.in_flight} micro-batch(es) "
                 f"in flight), {gradients / MIB:.2f} MiB parameter gradients and {beyond / MIB:.2f} MiB that the "
                 "measured steps showed beyond the layers (the backward's workspace, the optimizer's and the "
                 "engine's other buffers, one activation gradient in flight, a 1 % margin for small allocations)")
    return text + "."


def _length_rows(planned: PlannedStage) -> list[str]:
    """Variable lengths: the rows above are the longest micro-batch's plan; one
    row per length bucket, and the peak any mix keeps."""
    lengths = planned.lengths
    lines = ["", f"Variable-length micro-batches (measured at length {planned.measured_length}; each bucket measured "
             "at its longest length and planned for it):", "",
             "| length up to | stored / checkpointed / selective layers | held MiB / micro-batch | recompute ms "
             "| predicted peak MiB | measured peak MiB | every micro-batch this long: peak MiB = base + held + "
             "moment's, at |",
             "|---:|---|---:|---:|---:|---:|---|"]
    for length_plan in lengths.by_length:
        counts = length_plan.counts()
        note = f" (the plan of length {length_plan.borrowed_from})" if length_plan.borrowed_from else ""
        measured = planned.measured_by_length.get(length_plan.length)
        lines.append(f"| {length_plan.length} | {counts[Decision.STORE]} / {counts[Decision.CHECKPOINT]} / "
                     f"{counts[Decision.SELECTIVE]}{note} | {length_plan.held_bytes / MIB:.2f} "
                     f"| {length_plan.plan.recompute_s * 1e3:.2f} "
                     f"| {lengths.bound_up_to(length_plan.length) / MIB:.2f} "
                     f"| {'not seen' if measured is None else f'{measured / MIB:.2f}'} "
                     f"| {_terms_cell(length_plan, planned.layer_names)} |")
    lines += ["", f"Any mix of lengths in flight peaks at most at {lengths.bound_bytes / MIB:.2f} MiB of the "
              f"{planned.budget_bytes / MIB:.2f} MiB budget. A row's predicted peak is that of a step whose longest "
              "micro-batch is in its bucket; its measured peak, the highest of this plan's checked steps whose "
              f"longest micro-batch was. Planner time so far: {planned.planning_s:.2f} s."]
    return lines


def _terms_cell(length_plan: LengthPlan, names: list[str]) -> str:
    """A bucket's own peak (every micro-batch in flight of its edge's length), as its terms."""
    terms = peak_breakdown(length_plan.problem, length_plan.plan.segments)
    where = terms.moment.value + ("" if terms.segment is None else
                                  f" {_layers(names[terms.segment.start:terms.segment.end])}")
    return (f"{terms.peak_bytes / MIB:.2f} = {terms.base_bytes / MIB:.2f} + {terms.held_bytes / MIB:.2f} + "
            f"{terms.transient_bytes / MIB:.2f}, {where}")
