"""The tensor (model) parallel group that partitioned activations are split over."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = ["TensorParallelGroup"]

# (group, rank, world size) accessors, in order of preference. Megatron-style mpus
# have the tensor-model-parallel names; DeepSpeed's PipelineParallelGrid has the
# slice-parallel ones (its "model parallel" group spans pipeline stages too);
# older mpus only have the model-parallel ones.
_ACCESSORS = (
    ("get_tensor_model_parallel_group", "get_tensor_model_parallel_rank",
     "get_tensor_model_parallel_world_size"),
    ("get_slice_parallel_group", "get_slice_parallel_rank", "get_slice_parallel_world_size"),
    ("get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size"),
)


@dataclass(frozen=True)
class TensorParallelGroup:
    """A resolved model-parallel group. Also answers the mpu methods that
    ``deepspeed.checkpointing.configure`` calls, so it can be handed to it."""

    group: Any
    rank: int
    world_size: int
    mpu: Any = None

    @classmethod
    def single(cls) -> "TensorParallelGroup":
        """A group of this rank alone (nothing to partition over)."""
        return cls(group=None, rank=0, world_size=1)

    @classmethod
    def from_mpu(cls, mpu: Any) -> "TensorParallelGroup":
        if isinstance(mpu, TensorParallelGroup):
            return mpu
        for group_fn, rank_fn, size_fn in _ACCESSORS:
            if all(callable(getattr(mpu, name, None)) for name in (group_fn, rank_fn, size_fn)):
                return cls(getattr(mpu, group_fn)(), int(getattr(mpu, rank_fn)()),
                           int(getattr(mpu, size_fn)()), mpu)
        raise ConfigError("mpu", mpu, "an object with get_model_parallel_group/rank/world_size methods "
                          "(or the tensor-/slice-parallel variants)")

    def get_tensor_model_parallel_group(self):
        return self.group

    def get_tensor_model_parallel_rank(self):
        return self.rank

    def get_tensor_model_parallel_world_size(self):
        return self.world_size

    def get_data_parallel_rank(self):
        return 0 if self.mpu is None else self.mpu.get_data_parallel_rank()
