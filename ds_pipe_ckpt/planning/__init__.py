"""Per-stage activation checkpointing plans for DeepSpeed's 1F1B pipeline.

For each pipeline stage, choose which layers to store, which to checkpoint
(and where the checkpoint regions start and end) and which to checkpoint
selectively, so that the recomputation time is least while the stage's
predicted peak memory, with its micro-batches in flight, stays within a
budget. The cost model and the solver are pure Python (no torch): the
layers' figures come in as :class:`LayerProfile` s.

* :mod:`.cost_model`: the problem (:class:`LayerProfile`, :class:`StageProblem`),
  plans (:class:`Segment`, :class:`Decision`) and their predicted peak
  (:func:`predicted_peak_bytes`) and recomputation time (:func:`recompute_seconds`).
* :mod:`.solver`: the exact optimiser :func:`plan_stage`, returning a
  :class:`StagePlan` or raising :class:`InfeasibleBudgetError` with the least
  feasible budget, also given by :func:`minimum_peak_bytes`.

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

from .cost_model import (Decision, LayerProfile, Segment, StageProblem, predicted_peak_bytes,
                         recompute_seconds)
from .solver import InfeasibleBudgetError, StagePlan, minimum_peak_bytes, plan_stage

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
