"""The checkpointing paths compared, each as ``checkpoint(segment, x) -> y``
plus the ``ds_pipe_ckpt.configure`` settings it runs under.

Variants that need a process group (``world_size`` set) run in their own
ranks (:func:`benchmarks.checkpointing.measure.measure_in_rank`); the others run in the benchmark's
process. A variant whose settings ``ds_pipe_ckpt.configure`` rejects with
``NotImplementedError`` is reported as not available, with that message.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

import ds_pipe_ckpt

__all__ = ["CheckpointFn", "Variant", "VARIANTS", "VARIANT_NAMES", "ModelParallelUnit", "variant"]

CheckpointFn = Callable[..., torch.Tensor]


class ModelParallelUnit:
    """An ``mpu`` whose model-parallel group is ``group`` (the whole world when
    None) and whose data-parallel group is one rank, for ``configure(mpu=...)``."""

    def __init__(self, rank: int, world_size: int, group: Any = None):
        self.rank, self.world_size, self.group = rank, world_size, group

    def get_model_parallel_group(self) -> Any:
        return self.group if self.group is not None else torch.distributed.group.WORLD

    def get_model_parallel_rank(self) -> int:
        return self.rank

    def get_model_parallel_world_size(self) -> int:
        return self.world_size

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1


@dataclass(frozen=True)
class Variant:
    """One checkpointing path.

    Attributes:
        name: the name used in the table and the JSON.
        description: what it calls.
        checkpoint: ``checkpoint(segment, x)``, or None for no checkpointing.
        settings: keyword arguments of ``ds_pipe_ckpt.configure`` to run under.
        world_size: ranks to run in (the model-parallel group spans them all),
            or None to run in the benchmark's process.
        has_floor: whether :mod:`benchmarks.checkpointing.floor` bounds its peak (it keeps
            every segment input on the device and recomputes per segment).
    """

    name: str
    description: str
    checkpoint: CheckpointFn | None
    settings: dict = field(default_factory=dict)
    world_size: int | None = None
    has_floor: bool = True

    @contextlib.contextmanager
    def configured(self, rank: int = 0) -> Iterator[None]:
        """Apply this variant's settings; restore the defaults on exit."""
        ds_pipe_ckpt.configure(**self._configure_kwargs(rank))
        try:
            yield
        finally:
            ds_pipe_ckpt.configure()

    def unavailable_reason(self) -> str | None:
        """Why ``configure`` rejects the settings with ``NotImplementedError``, or
        None. Leaves the default settings in force.

        A multi-rank variant is probed here without its process group; any other
        error from that probe is left for its ranks to raise for real.
        """
        try:
            ds_pipe_ckpt.configure(**self._configure_kwargs(rank=0))
        except NotImplementedError as error:
            return str(error)
        except Exception:
            if self.world_size is None:
                raise
        finally:
            ds_pipe_ckpt.configure()
        return None

    def _configure_kwargs(self, rank: int) -> dict:
        kwargs = dict(self.settings)
        if self.world_size and kwargs.get("partition_activations"):
            kwargs["mpu"] = ModelParallelUnit(rank, self.world_size)
        return kwargs


def _ours(use_reentrant: bool) -> CheckpointFn:
    return functools.partial(ds_pipe_ckpt.checkpoint, use_reentrant=use_reentrant)


VARIANTS = (
    Variant("none", "no checkpointing", None, has_floor=False),
    Variant("torch_non_reentrant", "torch.utils.checkpoint.checkpoint(use_reentrant=False)",
            functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)),
    Variant("deepspeed_reentrant", "deepspeed.checkpointing.checkpoint", ds_checkpointing.checkpoint),
    Variant("deepspeed_non_reentrant",
            "deepspeed.runtime.activation_checkpointing.checkpointing.non_reentrant_checkpoint",
            ds_checkpointing.non_reentrant_checkpoint),
    Variant("ours_reentrant", "ds_pipe_ckpt.checkpoint(use_reentrant=True)", _ours(True)),
    Variant("ours_non_reentrant", "ds_pipe_ckpt.checkpoint(use_reentrant=False)", _ours(False)),
    Variant("ours_non_reentrant_run_to_end",
            "ds_pipe_ckpt.checkpoint(use_reentrant=False), \"early_stop\": false (the stricter check)",
            _ours(False), settings={"use_reentrant": False, "early_stop": False}),
    Variant("ours_selective", "ds_pipe_ckpt.checkpoint(use_reentrant=False), \"policy\": \"selective\"",
            _ours(False), settings={"use_reentrant": False, "policy": "selective"}, has_floor=False),
    Variant("ours_partitioned", "ds_pipe_ckpt.checkpoint(use_reentrant=False), partition_activations, mp=2",
            _ours(False), settings={"use_reentrant": False, "partition_activations": True},
            world_size=2, has_floor=False),
    Variant("ours_cpu_offload", "ds_pipe_ckpt.checkpoint(use_reentrant=False), cpu_checkpointing",
            _ours(False), settings={"use_reentrant": False, "checkpoint_in_cpu": True}, has_floor=False),
)

VARIANT_NAMES = tuple(v.name for v in VARIANTS)


def variant(name: str) -> Variant:
    """The variant called ``name``."""
    for candidate in VARIANTS:
        if candidate.name == name:
            return candidate
    raise KeyError(f"unknown variant {name!r}; known: {', '.join(VARIANT_NAMES)}")
