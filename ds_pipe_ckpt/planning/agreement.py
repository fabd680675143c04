"""Planning decisions agreed across every rank of a pipeline job.

Each stage plans on its own ranks, at the start of a training step. A stage
that cannot keep its budget raises :class:`~ds_pipe_ckpt.ConfigError`; if only
its ranks raised, the other stages would go on into their next send or
receive and wait for a peer that never comes (a launcher that kills the job
on one failure hides this; ``srun``, or code that catches the error, does
not). So every rank takes part in one collective at each step start where a
stage may plan, and all of them raise the same error there.

Where a stage may plan is known on every rank: the first plan follows the
measuring step, which every stage runs at the same step; a later plan
follows a checked step whose peak did not fit its prediction. Each agreement
also tells whether any rank may plan again at a later step start (a plan not
yet checked), so that the next agreement is held by all ranks or by none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..errors import ConfigError

__all__ = ["PlanningOutcome", "agree"]


@dataclass(frozen=True)
class PlanningOutcome:
    """What one rank's planning at a step start came to, as sent to the others."""

    stage: int
    may_plan_again: bool
    # A failure: the ConfigError's fields, or another exception's type and message.
    config_error: tuple | None = None  # (key, value, allowed, hint)
    other_error: str | None = None

    @classmethod
    def of(cls, stage: int, error: BaseException | None, may_plan_again: bool) -> "PlanningOutcome":
        if error is None:
            return cls(stage, may_plan_again)
        if isinstance(error, ConfigError):
            return cls(stage, may_plan_again, config_error=(error.key, error.value, error.allowed, error.hint))
        return cls(stage, may_plan_again, other_error=f"{type(error).__name__}: {error}")

    @property
    def failed(self) -> bool:
        return self.config_error is not None or self.other_error is not None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree(stage: int, error: BaseException | None, may_plan_again: bool) -> bool:
    """Share this rank's planning outcome with every rank of the job; returns
    whether any rank may plan again at a later step start.

    Raises:
        ConfigError: on every rank, the same one, when a stage could not plan
            within its budget: the error of the lowest such stage, which names
            that stage and its least budget, with the stages that failed.
        RuntimeError: on every rank but the failing ones (which re-raise their
            own), when planning failed otherwise on some stage.
    """
    mine = PlanningOutcome.of(stage, error, may_plan_again)
    if _distributed():
        outcomes: list[PlanningOutcome | None] = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, mine)
    else:
        outcomes = [mine]
    failures = sorted((o for o in outcomes if o.failed), key=lambda o: (o.config_error is None, o.stage))
    if not failures:
        return any(o.may_plan_again for o in outcomes)
    first = failures[0]
    stages = sorted({o.stage for o in failures})
    if first.config_error is not None:
        key, value, allowed, hint = first.config_error
        named = ", ".join(str(s) for s in stages)
        raise ConfigError(key, value, allowed, f"{hint} Raised on every rank at this step's start (pipeline "
                          f"stage{'s' if len(stages) > 1 else ''} {named} cannot keep {key}), so that no stage "
                          "waits for another that stopped.") from error
    if error is not None:
        raise error
    raise RuntimeError(f"ds_pipe_ckpt: pipeline stage {first.stage} failed to plan its checkpointing at this step's "
                       f"start ({first.other_error}); every rank stops here rather than wait for it.")
