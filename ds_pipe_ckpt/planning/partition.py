"""Stage boundaries and each stage's checkpointing, chosen together.

DeepSpeed cuts a pipeline's layers before anything is known about their time
or activation memory (``partition_method`` "parameters", "uniform",
"type:..."); the per-stage planner can then only make each stage fit. Here the
cut is chosen with the plans: for ``pp`` stages over a chain of ``n`` layers,
stage ``s`` covering layers ``[a, b)`` keeps ``k_s = min(pp - s, m)``
micro-batches in flight under DeepSpeed's 1F1B schedule (``m`` micro-batches
per step) and gets the least-recomputation plan within its budget
(:func:`~.solver.plan_stage`). Its time per micro-batch is

    t_s = sum over its layers of (forward + backward) + its plan's recomputation
          (+ the loss's forward and backward on the last stage)

and the step's time under 1F1B is modelled as one micro-batch through every
stage (the fill and the drain) plus ``m - 1`` more at the pace of the
slowest stage::

    step = sum_s t_s + (m - 1) * max_s t_s

(communication between stages is not modelled). The partition of least step
time wins, then the one whose slowest stage is fastest, then the earliest
boundaries.

Each stage's problem is the per-stage planner's: the stage's first layer
keeps nothing of its input, stored or checkpointed (the engine holds the
stage input, and ``input_saved_bytes`` of its saved bytes are that input),
and what does
not depend on the plan (``base``) is the engine's copies of the stage's
inputs and outputs for the micro-batches in flight plus one incoming and one
outgoing gradient, ``(k_s + 1) * (x_a + x_b)``, the gradients of its
parameters where they are held through the step (more micro-batches than in
flight), the per-stage planner's two margins (``planner_margins``: one
activation gradient in flight between its layers, the largest tensor
crossing a boundary inside the stage; and small allocations, 1% of the
budget, at least 4 KiB), and
``extra_bytes[s]`` (a margin the caller knows, e.g. what a measured step
showed beyond the model). On the last stage, what the loss saves for its
backward (``loss_saved_bytes``: a cross-entropy's log-probabilities, as large
as the logits) is held at the start of the backward beyond the activations
(``StageProblem.backward_start_bytes``).

Search: for each candidate bottleneck ``T`` (a feasible stage's time), a
dynamic program over (stage, first layer) gives the least ``sum_s t_s``
with every ``t_s <= T``; candidates are visited by increasing ``T`` and the
visit stops once ``(m - 1) * T`` alone reaches the best step found.
``O(pp * n^2)`` stage plans (cached) and ``O(pp * n^2)`` per candidate.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from .cost_model import SMALL_ALLOCATIONS_MIN_BYTES, SMALL_ALLOCATIONS_SHARE, gradients_as_base
from .minimum_budget import InfeasibleBudgetError
from .plan import StagePlan
from .problem import LayerProfile, StageProblem
from .solver import plan_stage

__all__ = ["PartitionPlan", "PartitionProblem", "InfeasiblePartitionError", "plan_partition", "plan_cut"]


@dataclass(frozen=True)
class PartitionProblem:
    """A chain of layers to cut into ``stages`` pipeline stages.

    ``layers[i].input_bytes`` is the full size of layer ``i``'s input (what a
    stage starting there receives); ``output_bytes`` is the last layer's
    output; ``backward_s[i]`` the time of layer ``i``'s backward (without
    recomputation). ``budget_bytes`` and ``extra_bytes`` have one entry per
    stage (``extra_bytes`` defaults to zeros). Every stage gets at least one
    layer.

    Raises ValueError naming the field for fewer layers than stages, lists of
    the wrong length, negative or non-finite figures.
    """

    layers: tuple[LayerProfile, ...]
    backward_s: tuple[float, ...]
    output_bytes: int
    stages: int
    micro_batches: int
    budget_bytes: tuple[int, ...]
    extra_bytes: tuple[int, ...] = ()
    allow_selective: bool = True
    loss_s: float = 0.0
    loss_saved_bytes: int = 0
    planner_margins: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "backward_s", tuple(float(t) for t in self.backward_s))
        object.__setattr__(self, "budget_bytes", tuple(self.budget_bytes))
        object.__setattr__(self, "extra_bytes", tuple(self.extra_bytes) or (0,) * self.stages)
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 1:
            raise ValueError(f"PartitionProblem: stages must be a positive int, got {self.stages!r}")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"PartitionProblem: micro_batches must be a positive int, got {self.micro_batches!r}")
        if len(self.layers) < self.stages:
            raise ValueError(f"PartitionProblem: {len(self.layers)} layers cannot fill {self.stages} stages "
                             "(each stage needs at least one layer)")
        if len(self.backward_s) != len(self.layers):
            raise ValueError(f"PartitionProblem: backward_s has {len(self.backward_s)} entries for "
                             f"{len(self.layers)} layers")
        if any(not math.isfinite(t) or t < 0 for t in self.backward_s):
            raise ValueError(f"PartitionProblem: backward_s must be finite and >= 0, got {self.backward_s}")
        for field in ("budget_bytes", "extra_bytes"):
            values = getattr(self, field)
            if len(values) != self.stages:
                raise ValueError(f"PartitionProblem: {field} needs one entry per stage ({self.stages}), "
                                 f"got {len(values)}")
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
                raise ValueError(f"PartitionProblem: {field} must be non-negative ints, got {values}")
        for field in ("output_bytes", "loss_saved_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"PartitionProblem: {field} must be a non-negative int, got {value!r}")
        if isinstance(self.loss_s, bool) or not isinstance(self.loss_s, (int, float)) \
                or not math.isfinite(self.loss_s) or self.loss_s < 0:
            raise ValueError(f"PartitionProblem: loss_s must be finite and >= 0, got {self.loss_s!r}")

    def in_flight(self, stage: int) -> int:
        """k_s: micro-batches stage ``stage`` holds at once under 1F1B."""
        return min(self.stages - stage, self.micro_batches)

    def boundary_bytes(self, position: int) -> int:
        """Bytes crossing the boundary before layer ``position`` (n: the output)."""
        return self.output_bytes if position == len(self.layers) else self.layers[position].input_bytes

    def stage_problem(self, stage: int, start: int, end: int) -> StageProblem:
        """The per-stage planner's problem for ``stage`` covering layers ``[start, end)``."""
        k = self.in_flight(stage)
        layers = list(self.layers[start:end])
        # The engine holds the stage input whatever the plan: the first layer keeps
        # nothing of it, stored or checkpointed.
        first = layers[0]
        saved = first.saved_bytes - first.input_saved_bytes
        selective = None if first.selective_saved_bytes is None else min(first.selective_saved_bytes, saved)
        layers[0] = dataclasses.replace(first, input_bytes=0, input_saved_bytes=0, saved_bytes=saved,
                                        selective_saved_bytes=selective)
        layers, gradients = gradients_as_base(layers, k, self.micro_batches)
        budget = self.budget_bytes[stage]
        # The per-stage planner's margins: one activation gradient in flight, small allocations.
        margins = 0
        if self.planner_margins:
            margins = (max(self.boundary_bytes(i) for i in range(start, end))
                       + max(SMALL_ALLOCATIONS_MIN_BYTES, int(SMALL_ALLOCATIONS_SHARE * budget)))
        base = ((k + 1) * (self.boundary_bytes(start) + self.boundary_bytes(end)) + gradients + margins
                + self.extra_bytes[stage])
        last = end == len(self.layers)
        return StageProblem(layers=layers, in_flight=k, budget_bytes=budget,
                            base_bytes=base, label=f"stage {stage} (layers {start}-{end - 1})",
                            allow_selective=self.allow_selective,
                            backward_start_bytes=self.loss_saved_bytes if last else 0)

    def stage_seconds(self, start: int, end: int, plan: StagePlan) -> float:
        """t_s of a stage covering layers ``[start, end)`` under ``plan``."""
        work = sum(layer.forward_s + backward for layer, backward in zip(self.layers[start:end],
                                                                            self.backward_s[start:end]))
        return work + plan.recompute_s + (self.loss_s if end == len(self.layers) else 0.0)


@dataclass(frozen=True)
class PartitionPlan:
    """The chosen cut: ``boundaries`` (the first layer of each stage, then n),
    each stage's :class:`~.plan.StagePlan` and time per micro-batch, and the
    modelled step time."""

    boundaries: tuple[int, ...]
    stage_plans: tuple[StagePlan, ...]
    stage_seconds: tuple[float, ...]
    step_seconds: float

    @property
    def stage_layers(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` of each stage's layers."""
        return tuple(zip(self.boundaries, self.boundaries[1:]))


class InfeasiblePartitionError(ValueError):
    """No cut of the layers lets every stage fit its budget."""


def plan_partition(problem: PartitionProblem) -> PartitionPlan:
    """The partition of least modelled step time (module docstring).

    Raises:
        InfeasiblePartitionError: no cut fits every stage's budget; the
            message gives, per stage, the least budget any of its feasible
            layer ranges would need.
    """
    n, pp, m = len(problem.layers), problem.stages, problem.micro_batches
    plans: dict[tuple[int, int, int], StagePlan | None] = {}
    least_needed: dict[int, int] = {}

    def stage(s: int, a: int, b: int) -> tuple[float, StagePlan] | None:
        key = (s, a, b)
        if key not in plans:
            try:
                plans[key] = plan_stage(problem.stage_problem(s, a, b))
            except InfeasibleBudgetError as error:
                plans[key] = None
                least_needed[s] = min(least_needed.get(s, error.minimum_bytes), error.minimum_bytes)
        plan = plans[key]
        return None if plan is None else (problem.stage_seconds(a, b, plan), plan)

    # Stage s may start at layer a when the stages before fill [0, a) and those after [b, n).
    ranges = [(s, a, b) for s in range(pp) for a in range(s, n - (pp - s) + 1)
              for b in range(a + 1, n - (pp - s - 1) + 1) if (s > 0 or a == 0) and (s < pp - 1 or b == n)]
    timed = {key: result for key in ranges if (result := stage(*key)) is not None}
    best: tuple[float, float, tuple[int, ...]] | None = None
    for bottleneck in sorted({seconds for seconds, _ in timed.values()}):
        if best is not None and (m - 1) * bottleneck >= best[0]:
            break
        found = _least_sum(n, pp, timed, bottleneck)
        if found is None:
            continue
        total, boundaries = found
        slowest = max(timed[(s, a, b)][0] for s, (a, b) in enumerate(zip(boundaries, boundaries[1:])))
        candidate = (total + (m - 1) * slowest, slowest, boundaries)
        if best is None or candidate < best:
            best = candidate
    if best is None:
        needs = ", ".join(f"stage {s}: at least {least_needed[s] / 2**20:.2f} MiB" for s in sorted(least_needed))
        raise InfeasiblePartitionError(
            f"no cut of {n} layers into {pp} stages fits every stage's memory budget ({m} micro-batches per "
            f"step); where a stage's layer ranges did not fit, the least budget any of them needs: {needs}")
    return _assembled(problem, best[2], [timed[(s, a, b)] for s, (a, b) in enumerate(zip(best[2], best[2][1:]))])


def plan_cut(problem: PartitionProblem, boundaries: Sequence[int]) -> PartitionPlan:
    """Each stage's plan and the modelled step for a given cut (say,
    DeepSpeed's ``"parameters"`` one), for comparison with :func:`plan_partition`'s.

    Raises:
        ValueError: ``boundaries`` is not ``0 = b_0 < b_1 < ... < b_pp = n``.
        InfeasiblePartitionError: a stage of this cut fits no plan within its
            budget (named, with the least budget it needs).
    """
    boundaries = tuple(int(b) for b in boundaries)
    n = len(problem.layers)
    if (len(boundaries) != problem.stages + 1 or boundaries[0] != 0 or boundaries[-1] != n
            or any(a >= b for a, b in zip(boundaries, boundaries[1:]))):
        raise ValueError(f"plan_cut: boundaries {list(boundaries)} do not cut {n} layers into {problem.stages} "
                         "non-empty stages (0 = b_0 < ... < b_pp = n)")
    stages = []
    for s, (a, b) in enumerate(zip(boundaries, boundaries[1:])):
        try:
            plan = plan_stage(problem.stage_problem(s, a, b))
        except InfeasibleBudgetError as error:
            raise InfeasiblePartitionError(
                f"stage {s} (layers {a}-{b - 1}) fits no plan within {problem.budget_bytes[s] / 2**20:.2f} MiB; "
                f"it needs at least {error.minimum_bytes / 2**20:.2f} MiB") from error
        stages.append((problem.stage_seconds(a, b, plan), plan))
    return _assembled(problem, boundaries, stages)


def _assembled(problem: PartitionProblem, boundaries: tuple[int, ...],
               stages: list[tuple[float, StagePlan]]) -> PartitionPlan:
    seconds = tuple(t for t, _ in stages)
    return PartitionPlan(boundaries=tuple(boundaries), stage_plans=tuple(plan for _, plan in stages),
                         stage_seconds=seconds, step_seconds=sum(seconds) + (problem.micro_batches - 1) * max(seconds))


def _least_sum(n: int, pp: int, timed: dict, bottleneck: float) -> tuple[float, tuple[int, ...]] | None:
    """The least sum of stage times of a cut whose stages all take at most
    ``bottleneck``, and its boundaries; None when there is none."""
    # best[s][a]: least sum of the times of stages s.. when stage s starts at layer a.
    best: list[list[tuple[float, tuple[int, ...]] | None]] = [[None] * (n + 1) for _ in range(pp + 1)]
    best[pp][n] = (0.0, (n,))
    for s in reversed(range(pp)):
        for a in range(n):
            choice = None
            for b in range(a + 1, n + 1):
                entry = timed.get((s, a, b))
                after = best[s + 1][b]
                if entry is None or after is None or entry[0] > bottleneck:
                    continue
                candidate = (entry[0] + after[0], (a, *after[1]))
                if choice is None or candidate < choice:
                    choice = candidate
            best[s][a] = choice
    return best[0][0]
