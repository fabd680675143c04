"""Where the inputs a checkpointed region saves for its recomputation live:
partitioned across the model-parallel group and/or offloaded to host memory,
in pooled buffers, with optional boundary synchronisation and profiling.

torch's non-reentrant checkpoint saves a region's inputs through the
saved-tensor hooks of :class:`ds_pipe_ckpt.inputs.SavedInputs` (and only
those; the tensors saved inside the region go to torch's own hooks), which
hands them, when the forward has ended, to the region's
:class:`RegionPlacement`: a :class:`~ds_pipe_ckpt.placement.stash.SegmentStash`
shards/offloads them all at once and gathers them with one collective when
the recomputation starts.

The state these need across checkpoints (the buffer pool, the profiler's
records) lives in a :class:`CheckpointRuntime` attached to the
:class:`~ds_pipe_ckpt.settings.CheckpointingSettings` in force; a new
``configure()`` starts a new one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from ..compat import all_gather_single
from ..config import CheckpointingConfig
from .pool import BufferPool
from ..errors import ConfigError
from ..parallel import TensorParallelGroup
from .profiling import CheckpointProfiler, CheckpointRecord
from ..settings import CheckpointingSettings, current_settings
from ..upstream_checkpointing import ORIGINAL_RESET
from .stash import SegmentStash

__all__ = ["placement_for", "inputs_are_placed", "RegionPlacement", "reset", "profile_records", "CheckpointRuntime"]


class CheckpointRuntime:
    """What the checkpoints of one configuration share."""

    def __init__(self, config: CheckpointingConfig, model_parallel: TensorParallelGroup | None):
        self.config = config
        self.partitioned = config.partition_activations
        self.group = None
        self.rank, self.world_size = 0, 1
        # Without a model-parallel group there is one rank to partition over
        # (configure() notes it once).
        if self.partitioned and model_parallel is not None:
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
        # Whether checkpoints need anything from this runtime at all (read on every call).
        self.active = self.places_inputs or config.synchronize_checkpoint_boundary or self.profiler is not None

    @staticmethod
    def _synchronize() -> None:
        get_accelerator().synchronize()

    def synchronize_boundary(self) -> None:
        """``synchronize_checkpoint_boundary``: wait for the device at each checkpoint boundary."""
        if self.config.synchronize_checkpoint_boundary:
            self._synchronize()

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        """The one collective of a partitioned segment's recomputation."""
        all_gather_single(output, shard, group=self.group)

    def reset(self) -> None:
        if self.pool is not None:
            self.pool.reset()


class RegionPlacement:
    """Where one checkpointed region's saved inputs go, and the synchronisation
    and timing around its forward and recomputation.

    :class:`ds_pipe_ckpt.inputs.SavedInputs` calls :meth:`begin_forward` before
    the region runs, :meth:`store` with the inputs to keep when its forward has
    ended (when :attr:`holds_inputs`), :meth:`end_forward`, and :meth:`unpack`
    for each input the recomputation needs; :class:`ds_pipe_ckpt.region_call.RegionCall`
    brackets each recomputation with :meth:`begin_recomputation` and
    :meth:`end_recomputation`.
    """

    def __init__(self, runtime: CheckpointRuntime):
        self.runtime = runtime
        runtime.checkpoints += 1
        self.index = runtime.checkpoints
        self.record: CheckpointRecord | None = None
        self._stash: SegmentStash | None = None
        self._started: float | None = None

    @property
    def holds_inputs(self) -> bool:
        """Whether the inputs are copied into this placement when the forward ends."""
        return self.runtime.places_inputs

    def begin_forward(self, label: str) -> None:
        runtime = self.runtime
        if runtime.profiler is not None:
            self.record = runtime.profiler.new_record(self.index, label)
            self._started = runtime.profiler.start()
        runtime.synchronize_boundary()

    def store(self, tensors: list[torch.Tensor]) -> list[int]:
        """Keep ``tensors`` as configured; return the index each is unpacked by."""
        self._stash = SegmentStash(self.runtime, self.record)
        indices = [self._stash.pack(tensor) for tensor in tensors]
        self._stash.seal()
        return indices

    def end_forward(self) -> None:
        runtime = self.runtime
        runtime.synchronize_boundary()
        if self._started is not None:
            self.record.forward_s = runtime.profiler.stop(self._started)
            runtime.profiler.log(self.record, "forward")

    def unpack(self, index: int) -> torch.Tensor:
        return self._stash.unpack(index)

    def begin_recomputation(self) -> float | None:
        """Before a recomputation: synchronise and start its timer, as configured."""
        runtime = self.runtime
        runtime.synchronize_boundary()
        return runtime.profiler.start() if runtime.profiler is not None else None

    def end_recomputation(self, started: float | None) -> None:
        """After a recomputation, also one torch stopped early by raising."""
        runtime = self.runtime
        runtime.synchronize_boundary()
        if started is not None:
            self.record.recompute_s = runtime.profiler.stop(started)
            runtime.profiler.log(self.record, "recompute")


def placement_for(settings: CheckpointingSettings) -> RegionPlacement | None:
    """A placement for one checkpoint call under ``settings``, or None when no
    ``activation_checkpointing`` option needs one (inputs are then kept by
    reference, nothing is synchronised or timed). The checkpoints of one
    settings object share its runtime (buffer pool, profile records)."""
    runtime = settings.runtime
    if runtime is None:
        runtime = settings.runtime = CheckpointRuntime(settings.config, settings.model_parallel)
    return RegionPlacement(runtime) if runtime.active else None


def inputs_are_placed(settings: CheckpointingSettings) -> bool:
    """Whether checkpoints under ``settings`` keep their inputs elsewhere than
    where they are (partitioned across the model-parallel group, on the CPU,
    in contiguous buffers): then checkpointing frees an input's memory even
    where the region saves nothing else."""
    runtime = settings.runtime
    if runtime is None:
        runtime = settings.runtime = CheckpointRuntime(settings.config, settings.model_parallel)
    return runtime.places_inputs


def reset() -> None:
    """Release the buffers that hold checkpointed inputs: drop-in for
    ``deepspeed.checkpointing.reset``, which does the same since
    ds_pipe_ckpt is imported. The settings in force are not touched.

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
    ORIGINAL_RESET()


def profile_records() -> list[CheckpointRecord]:
    """The most recent per-checkpoint timings (``activation_checkpointing.profile``)."""
    runtime = current_settings().runtime
    if runtime is None or runtime.profiler is None:
        return []
    return list(runtime.profiler.records)
