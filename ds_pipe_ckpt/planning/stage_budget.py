"""A pipeline stage's memory budget, as the planner holds the stage to it:
the budget ``max_memory_mb`` leaves once a step's start is known, the error
when no plan fits it, and the verdict on a planned step's measured peak.

Pure functions: numbers in, numbers, verdicts and
:class:`~ds_pipe_ckpt.ConfigError` s out; no module, no device, no ranks (torch
is imported only by :mod:`ds_pipe_ckpt.errors`). It must not measure or plan
(:mod:`.stage` does).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["PREDICTION_TOLERANCE", "MAX_CALIBRATIONS", "AUTO_MARGIN", "auto_max_memory_bytes", "budget_from_max_memory",
           "no_plan_fits", "StepCheck"]

# The prediction is an upper bound of the measured peak (a step above it is
# planned again); this is how far above the measured peak it may be, the
# accuracy the pipeline benchmark holds every checked step to.
PREDICTION_TOLERANCE = 0.10
MAX_CALIBRATIONS = 2  # plans made again after a measured step that did not fit the prediction
MIB = 2**20
# max_memory_mb "auto": a CUDA device's capacity less this share, for what the
# caching allocator's counters do not see: the CUDA context, NCCL's buffers and
# the allocator's fragmentation.
AUTO_MARGIN = 0.10


def auto_max_memory_bytes(key: str, stage: int, device_type: str, capacity_bytes: int) -> int:
    """``max_memory_mb: "auto"`` on a device of ``capacity_bytes``: that less
    :data:`AUTO_MARGIN`; a ConfigError naming ``key`` on a device other than CUDA."""
    if device_type != "cuda":
        raise ConfigError(key, "auto", "a number of MiB on a device other than CUDA",
                          f"\"auto\" is a CUDA device's capacity; pipeline stage {stage} runs on {device_type}.")
    return int(capacity_bytes * (1 - AUTO_MARGIN))


def budget_from_max_memory(key: str, max_memory_bytes: int, step_start_bytes: int | None, stage: int) -> int:
    """``max_memory_bytes`` less what a step begins with (``step_start_bytes``,
    measured on the stage's measuring step; None: that step ran under another
    profiler); a ConfigError naming ``key`` where nothing would be left."""
    if step_start_bytes is None:
        raise ConfigError(key, round(max_memory_bytes / MIB, 3), "a budget measured on the stage's second step",
                          f"Pipeline stage {stage}'s second step ran under another profiler, so what a "
                          "step begins with is unknown; leave that step unprofiled, or use memory_budget_mb.")
    if max_memory_bytes <= step_start_bytes:
        raise ConfigError(key, round(max_memory_bytes / MIB, 3),
                          f"more than the {step_start_bytes / MIB:.2f} MiB allocated when a step begins "
                          f"on pipeline stage {stage}",
                          "That is the parameters, their gradients where they outlive steps, and the "
                          "optimizer's state: nothing is left for the step itself.")
    return max_memory_bytes - step_start_bytes


def no_plan_fits(key: str, *, stage: int, in_flight: int, budget_bytes: int, minimum_bytes: int,
                 step_start_bytes: int, floor: str, max_sequence_length: int | None) -> ConfigError:
    """The error for a budget no plan fits, in ``key``'s own terms (``max_memory_mb``
    counts the ``step_start_bytes`` a step begins with too; else pass 0):
    the smallest budget that fits, what its ``floor`` is made of, and what to change."""
    configured = budget_bytes + step_start_bytes
    smallest = (minimum_bytes + step_start_bytes) / MIB
    counted = (f" (with the {step_start_bytes / MIB:.2f} MiB allocated when a step begins: parameters, gradients "
               "that outlive steps, optimizer state)" if step_start_bytes else "")
    longest = (f" or activation_checkpointing.max_sequence_length ({max_sequence_length}: the "
               "longest micro-batch planned for)" if max_sequence_length is not None else "")
    return ConfigError(
        key, round(configured / MIB, 3), f"at least {smallest:.2f} MiB for pipeline stage {stage}",
        f"No plan keeps this stage's predicted peak within the budget ({in_flight} micro-batch(es) "
        f"in flight; measured on its first micro-batches); {smallest:.2f} MiB is the smallest that fits"
        f"{counted}. {floor} Raise the budget, lower the micro-batch size{longest}, or use more stages.")


@dataclass(frozen=True)
class StepCheck:
    """A planned step's measured peak against its plan's prediction and the
    budget, after ``calibrations`` plans made again. The prediction must be an
    upper bound: a step above it, or above the budget, is planned again (at
    most :data:`MAX_CALIBRATIONS` times) with the difference counted as memory
    the model does not see. One well below it is only wasteful."""

    stage: int
    predicted_bytes: int
    measured_bytes: int
    budget_bytes: int
    calibrations: int

    @property
    def missed(self) -> bool:
        return self.measured_bytes > self.predicted_bytes or self.measured_bytes > self.budget_bytes

    @property
    def calibrates(self) -> bool:
        return self.missed and self.calibrations < MAX_CALIBRATIONS

    @property
    def unseen_bytes(self) -> int:
        """What the step showed beyond the prediction (counted when it calibrates)."""
        return self.measured_bytes - self.predicted_bytes

    def warning(self) -> str:
        """The words of a missed check."""
        predicted, measured = self.predicted_bytes, self.measured_bytes
        action = ("Planning again at the next step's start with the difference counted as memory the model "
                  "does not see; the new plan is checked in that step." if self.calibrates else "The plan stands.")
        return (f"ds_pipe_ckpt: pipeline stage {self.stage}'s checkpointing plan predicted a peak of "
                f"{predicted / MIB:.2f} MiB above the step's start; the step measured {measured / MIB:.2f} MiB "
                f"({(predicted - measured) / measured:+.0%}) against a budget of {self.budget_bytes / MIB:.2f} MiB. "
                f"{action} The memory model (what each layer saves, measured on one micro-batch, plus what the "
                "measuring step showed beyond it) misses some of this stage's memory, e.g. buffers that "
                "differ with the plan or between steps, or, with micro-batches of variable length, what the "
                "passes measured at each length could not show.")
