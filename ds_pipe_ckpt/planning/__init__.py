"""Per-stage activation checkpointing plans for DeepSpeed's 1F1B pipeline.

For each pipeline stage, choose which layers to store, which to checkpoint
(and where the checkpoint regions start and end) and which to checkpoint
selectively, so that the recomputation time is least while the stage's
predicted peak memory, with its micro-batches in flight, stays within a
budget. The cost model and the solver are pure Python (no torch): the
layers' figures come in as :class:`LayerProfile` s.

* :mod:`.problem`: the problem, the layers' figures (:class:`LayerProfile`)
  and what the plan must fit (:class:`StageProblem`);
* :mod:`.plan`: plans, :class:`Segment` s of the chain each with a
  :class:`Decision`, and :class:`StagePlan`, the plan the solver chooses;
* :mod:`.cost_model`: a plan's predicted peak (:func:`predicted_peak_bytes`)
  and recomputation time (:func:`recompute_seconds`);
* :mod:`.peak_breakdown`: where a plan's predicted peak falls and its terms
  (the printed plan's line below its table);
* :mod:`.solver`: the exact optimiser :func:`plan_stage`, with the bounds it
  prunes with in :mod:`.search_bounds` and, for a backward that keeps the
  graph, :mod:`.kept_graph_solver`;
* :mod:`.minimum_budget`: the least feasible budget, :func:`minimum_peak_bytes`,
  and :class:`InfeasibleBudgetError`, which :func:`plan_stage` raises with it.

Inside a pipeline stage (``PipelineModule.enable_planning``):

* :mod:`.profile`: each layer's figures, measured on a training micro-batch;
* :mod:`.stage`: :class:`~.stage.StagePlanner`, which measures, plans, follows
  the plan and checks its prediction, through:
* :mod:`.stage_measurement`: the stage's layers run one checkpointed region
  each, measured (the measuring step, a pass at another length);
* :mod:`.stage_lengths`: variable-length micro-batches: the bucket of each, the
  stage measured at every bucket edge;
* :mod:`.stage_problem` (pure): the solver's problem from those figures, with what
  the measuring step showed beyond the model, at every length; the floor's words;
* :mod:`.stage_budget`: the budget ``max_memory_mb`` leaves, the error when
  no plan fits, and the verdict on a checked step (``PREDICTION_TOLERANCE``);
* :mod:`.step_tracking`: one step's memory, from its start to the optimizer step;
* :mod:`.stage_phase`: the stage's phases (measuring, checking, replan due,
  planned, unplannable) and :func:`~.stage_phase.next_phase`, the one way
  between them;
* :mod:`.planned`: :class:`~.planned.PlannedStage`, what
  ``PipelineModule.checkpoint_plan`` exposes, and the table the planner prints.

Example::

    problem = StageProblem(layers=profiles, in_flight=min(pp - stage, micro_batches),
                           budget_bytes=40 << 30, base_bytes=static_bytes, label=f"stage {stage}")
    plan = plan_stage(problem)
    plan.checkpoint_boundaries  # ((start, end), ...) of the checkpointed calls
"""

from .cost_model import predicted_peak_bytes, recompute_seconds
from .minimum_budget import InfeasibleBudgetError, minimum_peak_bytes
from .plan import Decision, Segment, StagePlan
from .problem import LayerProfile, StageProblem
from .solver import plan_stage

__all__ = [
    "LayerProfile",
    "StageProblem",
    "Decision",
    "Segment",
    "predicted_peak_bytes",
    "recompute_seconds",
    "StagePlan",
    "InfeasibleBudgetError",
    "plan_stage",
    "minimum_peak_bytes",
]
