"""Enabling the memory-budget planner on one pipeline stage: the module's
arguments checked against the budget, then a
:class:`~ds_pipe_ckpt.planning.stage.StagePlanner` attached to the module.

It does not plan (the planner does, at the stage's first training step) and
does not read the DeepSpeed config (``ds_pipe_ckpt.initialize`` passes the
stage's values).
"""

from __future__ import annotations

from typing import Any

from .compat import require_checkpoint_hooks
from .config import LENGTH_BUCKETS, check_module_against_config

__all__ = ["enable_planning"]


def enable_planning(module: Any, budget_bytes: int | None, micro_batches: int, known_buffers: tuple = (), *,
                    max_memory_bytes: int | str | None = None, max_sequence_length: int | None = None,
                    sequence_dim: int = 1, length_buckets: int = LENGTH_BUCKETS, use_reentrant: bool) -> None:
    """Enable ``module``'s planner: choose per layer what to checkpoint under a
    per-stage memory budget (``activation_checkpointing.memory_budget_mb`` or
    ``max_memory_mb``; ``PipelineModule.enable_planning`` calls this). See
    :mod:`ds_pipe_ckpt.planning`.

    Args:
        module: the stage's :class:`~ds_pipe_ckpt.PipelineModule`.
        budget_bytes: this stage's budget: peak bytes above what is
            allocated when a training step begins (None with ``max_memory_bytes``).
        micro_batches: micro-batches per step (the engine's gradient
            accumulation steps), which with the stage's position gives the
            micro-batches in flight under DeepSpeed's 1F1B schedule.
        known_buffers: :class:`~ds_pipe_ckpt.planning.stage.KnownBuffer` s the
            engine allocates in every step (``ds_pipe_ckpt.initialize`` names
            ZeRO's reduce bucket), named when the budget's floor is reported.
        max_memory_bytes: instead of ``budget_bytes``, the peak the stage's
            device may hold in all (parameters, gradients, optimizer state,
            ZeRO's buffers, activations), or ``"auto"`` (CUDA: the device's
            capacity less 10%); the budget is that less what is allocated
            when the measuring step begins.
        max_sequence_length: with ``dynamic_shape=True`` (required then),
            the longest micro-batch along ``sequence_dim`` of the stage's
            tensors: every length up to it is planned, so that any mix in
            flight keeps the budget (:mod:`ds_pipe_ckpt.planning.shapes`), in
            ``length_buckets`` ranges (1: one plan, for the longest).
        use_reentrant: whether the module checkpoints in the reentrant mode
            (refused with a budget).
    """
    from .planning.shapes import SequenceLengths  # the planner is optional machinery
    from .planning.stage import StagePlanner

    key = "activation_checkpointing." + ("max_memory_mb" if budget_bytes is None else "memory_budget_mb")
    value = budget_bytes / 2**20 if budget_bytes is not None else max_memory_bytes
    if (budget_bytes is None) == (max_memory_bytes is None):
        raise ValueError("enable_planning: give budget_bytes or max_memory_bytes, one of them")
    require_checkpoint_hooks(key, value)
    check_module_against_config(key, value, interval=module.activation_checkpoint_interval,
                                dynamic_shape=module.dynamic_shape, use_reentrant=use_reentrant,
                                max_sequence_length=max_sequence_length)
    lengths = None
    if max_sequence_length is not None:
        lengths = SequenceLengths(max_sequence_length, sequence_dim, length_buckets)
    module.__dict__["_planner"] = StagePlanner(module, budget_bytes=budget_bytes, micro_batches=micro_batches,
                                               known_buffers=tuple(known_buffers),
                                               max_memory_bytes=max_memory_bytes, lengths=lengths)
