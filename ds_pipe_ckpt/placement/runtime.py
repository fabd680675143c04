"""Where the inputs a checkpointed segment saves for its recomputation live:
partitioned across the model-parallel group and/or offloaded to host memory,
in pooled buffers, with optional boundary synchronisation and profiling.

Implemented with ``torch.autograd.graph.saved_tensors_hooks`` around torch's
non-reentrant checkpoint: torch packs a segment's inputs through these hooks
(and only those; the tensors saved inside the segment go to torch's own hooks)
into a :class:`~ds_pipe_ckpt.placement.stash.SegmentStash`, which shards/offloads them
all at once when the forward ends and gathers them with one collective when
the recomputation starts.

The state these need across checkpoints (the buffer pool, the profiler's
records) lives in a :class:`CheckpointRuntime` attached to the
:class:`~ds_pipe_ckpt.settings.CheckpointingSettings` in force; a new
``configure()`` starts a new one.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

from ..config import CheckpointingConfig
from .pool import BufferPool
from ..errors import ConfigError
from ..parallel import TensorParallelGroup
from .profiling import CheckpointProfiler, CheckpointRecord
from ..settings import current_settings
from .stash import SegmentStash

__all__ = ["saved_input_hooks", "reset", "profile_records", "CheckpointRuntime"]


class CheckpointRuntime:
    """What the checkpoints of one configuration share."""

    def __init__(self, config: CheckpointingConfig, model_parallel: TensorParallelGroup | None):
        self.config = config
        self.partitioned = config.partition_activations
        self.group = None
        self.rank, self.world_size = 0, 1
        if self.partitioned:
            if model_parallel is None:
                raise ConfigError("activation_checkpointing.partition_activations", True,
                                  "false when no model-parallel group is known",
                                  "Pass mpu= to ds_pipe_ckpt.configure().")
            self.group, self.rank, self.world_size = (model_parallel.group, model_parallel.rank,
                                                      model_parallel.world_size)
            if self.world_size > 1:
                actual = dist.get_world_size(self.group)
                if actual != self.world_size:
                    raise ConfigError("mpu", model_parallel.mpu, f"a model-parallel group of {self.world_size} "
                                      f"ranks, as its world size says (the group has {actual})")
        # With a group of one, partitioning alone would copy each input to keep all of it.
        self.places_inputs = (config.cpu_checkpointing or config.contiguous_memory_optimization
                              or (self.partitioned and self.world_size > 1))
        self.pool = BufferPool(config.number_checkpoints) if config.contiguous_memory_optimization else None
        self.profiler = CheckpointProfiler(self._synchronize) if config.profile else None
        self.checkpoints = 0  # checkpoint calls so far, to number profile records

    @property
    def active(self) -> bool:
        """Whether checkpoints need anything from this runtime at all."""
        return self.places_inputs or self.config.synchronize_checkpoint_boundary or self.profiler is not None

    @staticmethod
    def _synchronize() -> None:
        get_accelerator().synchronize()

    def synchronize_boundary(self) -> None:
        """``synchronize_checkpoint_boundary``: wait for the device at each checkpoint boundary."""
        if self.config.synchronize_checkpoint_boundary:
            self._synchronize()

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        """The one collective of a partitioned segment's recomputation."""
        dist.all_gather_into_tensor(output, shard, group=self.group)

    def reset(self) -> None:
        if self.pool is not None:
            self.pool.reset()


def _runtime_for(config: CheckpointingConfig, model_parallel: TensorParallelGroup | None) -> CheckpointRuntime:
    settings = current_settings()
    if settings.config is config and settings.model_parallel is model_parallel:
        if settings.runtime is None:
            settings.runtime = CheckpointRuntime(config, model_parallel)
        return settings.runtime
    # A configuration other than the one in force: nothing to share with it.
    return CheckpointRuntime(config, model_parallel)


class _Recomputation:
    """``fn`` for torch's checkpoint: the first call is the forward, later calls are
    recomputations, which are synchronised and timed as configured."""

    def __init__(self, fn: Callable[..., Any], hooks: "_SegmentHooks"):
        functools.update_wrapper(self, fn, updated=())
        self._fn = fn
        self._hooks = hooks
        self._calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._calls += 1
        if self._calls == 1:
            return self._fn(*args, **kwargs)
        runtime, record = self._hooks.runtime, self._hooks.record
        profiler = runtime.profiler
        runtime.synchronize_boundary()
        started = profiler.start() if profiler is not None else None
        try:
            return self._fn(*args, **kwargs)  # torch may stop it early by raising: still timed
        finally:
            runtime.synchronize_boundary()
            if started is not None:
                record.recompute_s = profiler.stop(started)
                profiler.log(record, "recompute")


class _SegmentHooks:
    """The context manager around one ``torch.utils.checkpoint`` call."""

    def __init__(self, runtime: CheckpointRuntime):
        self.runtime = runtime
        runtime.checkpoints += 1
        self.index = runtime.checkpoints
        self.record: CheckpointRecord | None = None
        self.stash: SegmentStash | None = None
        self._saved_tensors_hooks = None
        self._started: float | None = None

    @property
    def holds_inputs(self) -> bool:
        """Whether the saved inputs are packed by these hooks (copied when the forward ends)."""
        return self.stash is not None

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap the checkpointed function so that recomputations are synchronised and timed."""
        if self.record is not None:
            self.record.label = _name_of(fn)
        return _Recomputation(fn, self)

    def __enter__(self) -> "_SegmentHooks":
        runtime = self.runtime
        if runtime.profiler is not None:
            self.record = runtime.profiler.new_record(self.index, "")
            self._started = runtime.profiler.start()
        runtime.synchronize_boundary()
        if runtime.places_inputs:
            self.stash = SegmentStash(runtime, self.record)
            self._saved_tensors_hooks = torch.autograd.graph.saved_tensors_hooks(self.stash.pack, self.stash.unpack)
            self._saved_tensors_hooks.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        runtime = self.runtime
        if self._saved_tensors_hooks is not None:
            self._saved_tensors_hooks.__exit__(exc_type, exc, tb)
            self._saved_tensors_hooks = None
            if exc_type is None:
                self.stash.seal()
        runtime.synchronize_boundary()
        if self._started is not None and exc_type is None:
            self.record.forward_s = runtime.profiler.stop(self._started)
            runtime.profiler.log(self.record, "forward")


class _Inactive:
    """Stands in for :class:`_SegmentHooks` when no option needs anything."""

    holds_inputs = False

    def __enter__(self) -> "_Inactive":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        return None

    @staticmethod
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn


_INACTIVE = _Inactive()


def _name_of(fn: Callable[..., Any]) -> str:
    region = getattr(fn, "region", None)  # ds_pipe_ckpt.recompute.RecomputeGuard names its region
    if region is not None:
        return str(region)
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def saved_input_hooks(config: CheckpointingConfig, model_parallel: TensorParallelGroup | None):
    """A context manager to wrap one ``torch.utils.checkpoint`` call in.

    Entering it returns an object whose ``wrap(fn)`` wraps the checkpointed
    function so that its recomputation is synchronised and timed too
    (``synchronize_checkpoint_boundary``, ``profile``); without the wrap the
    forward and the gather are still covered.
    """
    runtime = _runtime_for(config, model_parallel)
    if not runtime.active:
        return _INACTIVE
    return _SegmentHooks(runtime)


def reset() -> None:
    """Release the buffers that hold checkpointed inputs: drop-in for
    ``deepspeed.checkpointing.reset``.

    Not needed in training: a segment's pooled buffer returns to the pool when its
    recomputation has consumed it (or when its graph is freed without a backward).
    Call it after forwards run with grad enabled whose outputs are kept but never
    backpropagated (their segments keep their buffers until then), or to give the
    pool's memory back. Also resets DeepSpeed's own buffers, which the reentrant
    mode uses.
    """
    runtime = current_settings().runtime
    if runtime is not None:
        runtime.reset()
    ds_checkpointing.reset()


def profile_records() -> list[CheckpointRecord]:
    """The most recent per-checkpoint timings (``activation_checkpointing.profile``)."""
    runtime = current_settings().runtime
    if runtime is None or runtime.profiler is None:
        return []
    return list(runtime.profiler.records)
