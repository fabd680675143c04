"""Which of a :class:`~ds_pipe_ckpt.PipelineModule`'s uniform segments run
checkpointed: a segment whose checkpointing frees no memory runs plainly.

Reads the facts the module recorded at a segment's first checkpointed call;
it does not run segments or change the module's interval or mode.
"""

from __future__ import annotations

import logging
from typing import Any

from .placement.runtime import inputs_are_placed
from .settings import current_settings

__all__ = ["frees_nothing", "segment_choices"]

logger = logging.getLogger("ds_pipe_ckpt")


def frees_nothing(module: Any, start: int, end: int, *, user_chose: bool) -> bool:
    """Whether checkpointing ``module``'s segment ``[start, end)`` would free no
    memory: its first checkpointed call saved for backward only its inputs and
    its layers' parameters (an embedding, a head, a cast, a reshape), and no
    ``activation_checkpointing`` option keeps inputs elsewhere (partitioned or
    on the CPU, where checkpointing does free them). Such a segment runs
    plainly: the same tensors are kept, and no recomputation is paid. False
    where the user chose (``user_chose``: ``checkpointable_layers`` given, or a
    custom ``activation_checkpoint_func``)."""
    facts = module.__dict__.get("_facts_by_segment", {}).get((start, end))
    if facts is None or not facts.saves_only_inputs:
        return False
    if user_chose:
        return False
    if inputs_are_placed(current_settings()):
        return False
    noted = module.__dict__.setdefault("_noted_plain_segments", set())
    if (start, end) not in noted:
        noted.add((start, end))
        logger.info("ds_pipe_ckpt: %s runs without checkpointing from its second call on: its first "
                    "checkpointed call saved only its inputs and parameters for backward, so checkpointing "
                    "it frees no memory and costs a recomputation. Name its layers' classes in "
                    "checkpointable_layers to checkpoint it anyway.", module.segment_label(start, end))
    return True


def segment_choices(module: Any) -> dict[str, str]:
    """How each segment of ``module``'s current interval runs, by its label:
    ``"checkpointed"``; ``"plain"`` (not checkpointable: the interval is 0,
    ``checkpointable_layers`` or reentrant mode's parameter rule leaves it
    out); ``"plain: frees nothing"`` (its first call saved only its inputs and
    parameters, see :func:`frees_nothing`); ``"not called yet"`` for a
    checkpointable segment whose first call has not been seen."""
    interval, num_layers = module.activation_checkpoint_interval, len(module.forward_funcs)
    if interval == 0:
        return {module.segment_label(0, num_layers): "plain"} if num_layers else {}
    module._precompute_checkpointable_values()
    choices = {}
    for segment, start in enumerate(range(0, num_layers, interval)):
        end = min(start + interval, num_layers)
        facts = module.__dict__.get("_facts_by_segment", {}).get((start, end))
        if not module.is_checkpointable_results[segment]:
            choice = "plain"
        elif module._frees_nothing(start, end):
            choice = "plain: frees nothing"
        elif facts is None or facts.saves_only_inputs is None:
            choice = "not called yet"
        else:
            choice = "checkpointed"
        choices[module.segment_label(start, end)] = choice
    return choices
