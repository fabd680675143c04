"""``python -m benchmarks.pipeline --budget F [F ...]``: the planner against the
best uniform choice, at budgets that are fractions of each stage's peak
without checkpointing.

For each pipeline depth and fraction F, every stage's budget is F times its
peak in the ``none`` mode. Two rows per (pp, F):

* ``planned``: ``"activation_checkpointing": {"memory_budget_mb": [...]}`` with
  those budgets (one per stage); the planner measures on the first step, plans
  at the second, and the third step on is measured like every mode. Each
  budget runs in its own launch: a budget no plan fits fails on one stage (a
  ``ConfigError`` naming the smallest budget that fits), which is recorded.
* ``uniform_best``: the fastest of the uniform choices a user has
  (``activation_checkpoint_interval`` k = 1, 2, ... over the transformer
  blocks, or none) whose measured peak fits the same budget on every stage.

Both rows carry ``budget_bytes``; ``planned`` rows also the plan's predicted
peak and decisions.

It only reads records and builds modes: it starts no ranks and prints nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ds_pipe_ckpt.planning.stage_budget import MAX_CALIBRATIONS

from .modes import PipelineMode
from .report import MIB, PLANNED, UNIFORM_BEST, ModeSummary, infeasible_minimum

__all__ = ["PLANNED", "UNIFORM_BEST", "BudgetOutcome", "uniform_modes", "planned_mode", "stage_budgets",
           "uniform_best", "budget_records", "infeasible_minimum"]

UNIFORM_PREFIX = "uniform_"
# The planner measures on step 1, plans and checks its prediction on step 2 and,
# where a check shows the plan off, plans again and checks on each next step (at
# most MAX_CALIBRATIONS times); one step more is left alone, so that no check of
# the planner's runs into the benchmark's measured or timed steps.
PLANNED_WARMUP_STEPS = 2 + MAX_CALIBRATIONS + 1


def uniform_modes(max_interval: int) -> tuple[PipelineMode, ...]:
    """Uniform checkpointing, every ``k`` layers (transformer blocks only), for
    k = 1 .. ``max_interval``: what a user sets by hand."""
    return tuple(PipelineMode(f"{UNIFORM_PREFIX}{k}", f"activation_checkpoint_interval {k}, non-reentrant",
                              {"pipeline": {"activation_checkpoint_interval": k, "use_reentrant": False}})
                 for k in range(1, max_interval + 1))


def planned_mode(budgets_bytes: dict[int, int], fraction: float) -> PipelineMode:
    """The planner under per-stage budgets (bytes, by stage)."""
    budgets_mib = [budgets_bytes[stage] / MIB for stage in sorted(budgets_bytes)]
    return PipelineMode(PLANNED, f"memory_budget_mb = {fraction:g} x each stage's peak without checkpointing",
                        {"pipeline": {"activation_checkpoint_interval": 0, "use_reentrant": False},
                         "activation_checkpointing": {"memory_budget_mb": budgets_mib}},
                        warmup_steps=PLANNED_WARMUP_STEPS)


def stage_budgets(none: ModeSummary, fraction: float) -> dict[int, int]:
    """Each stage's budget: ``fraction`` of its peak without checkpointing."""
    if not 0 < fraction:
        raise ValueError(f"a budget fraction must be positive, got {fraction}")
    return {stage: int(peak * fraction) for stage, peak in none.peak_bytes_by_stage.items()}


def _fits(summary: ModeSummary, budgets: dict[int, int]) -> bool:
    return all(summary.peak_bytes_by_stage[stage] <= budget for stage, budget in budgets.items())


def uniform_best(candidates: list[ModeSummary], budgets: dict[int, int]) -> ModeSummary | None:
    """The fastest candidate whose peak fits ``budgets`` on every stage, or None."""
    fitting = [c for c in candidates if _fits(c, budgets)]
    return min(fitting, key=lambda c: c.step_time_s) if fitting else None


@dataclass
class BudgetOutcome:
    """One (pp, fraction): the budgets, the planned run's per-rank records (or why
    there are none) and the uniform candidate chosen."""

    pp: int
    fraction: float
    budgets: dict[int, int]
    planned: list[dict] = field(default_factory=list)
    infeasible: str | None = None  # the planner's error, when no plan fits
    uniform: ModeSummary | None = None
    uniform_records: list[dict] = field(default_factory=list)


def budget_records(outcome: BudgetOutcome) -> list[dict]:
    """The JSON rows of one outcome: ``planned`` and ``uniform_best`` records per
    rank, each with ``budget_bytes`` and ``budget_fraction``, or one
    ``unavailable`` record per row that could not run."""
    def tagged(record: dict, mode: str) -> dict:
        return record | {"mode": mode, "budget_fraction": outcome.fraction,
                         "budget_bytes": outcome.budgets[record["stage"]]}

    rows = []
    if outcome.planned:
        rows += [tagged(r, PLANNED) for r in outcome.planned]
    else:
        rows.append({"pp": outcome.pp, "mp": 1, "mode": PLANNED, "rank": 0, "budget_fraction": outcome.fraction,
                     "budgets_bytes": dict(outcome.budgets), "unavailable": outcome.infeasible or "did not run"})
    if outcome.uniform is not None:
        rows += [tagged(r, UNIFORM_BEST) | {"uniform_mode": r["mode"]} for r in outcome.uniform_records]
    else:
        rows.append({"pp": outcome.pp, "mp": 1, "mode": UNIFORM_BEST, "rank": 0, "budget_fraction": outcome.fraction,
                     "budgets_bytes": dict(outcome.budgets),
                     "unavailable": "no uniform interval (nor none) fits the budget on every stage"})
    return rows
