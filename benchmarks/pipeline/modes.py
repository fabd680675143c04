"""What ``python -m benchmarks.pipeline`` runs: the checkpointing modes (each a
patch of the DeepSpeed JSON config), the pipeline layouts, and the sizes.

A mode is a name, a description, the config keys it sets and the size of the
model-parallel axis it needs. Adding one (say a memory-budget planner's
``"planned"`` row with its own ``activation_checkpointing`` keys) is one more
entry in :func:`modes`.

Data only: it builds no engine and measures nothing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from examples.gpt.model import GPTConfig

__all__ = ["PipelineMode", "Layout", "Preset", "PRESETS", "modes", "base_config", "merge_config", "layouts",
           "micro_batches_in_flight"]

# Every checkpointed block its own segment.
_NON_REENTRANT = {"activation_checkpoint_interval": 1, "use_reentrant": False}


@dataclass(frozen=True)
class PipelineMode:
    """One activation-checkpointing mode of the pipeline.

    Attributes:
        name: the name in the table and the JSON (``mode``).
        description: what it runs, for the report.
        config: DeepSpeed config keys it sets, merged into :func:`base_config`.
        mp: size of the model-parallel axis it runs with (2 for partitioned
            activations, which shard checkpoint inputs across that group).
        warmup_steps: untimed steps before its memory is measured, if not the
            preset's (the planner needs more).
    """

    name: str
    description: str
    config: Mapping[str, Any] = field(default_factory=dict)
    mp: int = 1
    warmup_steps: int | None = None


def modes() -> tuple[PipelineMode, ...]:
    """The modes measured, in table order; ``none`` first (the baseline)."""
    return (
        PipelineMode("none", "no activation checkpointing", {"pipeline": {"activation_checkpoint_interval": 0}}),
        PipelineMode("reentrant", "every block checkpointed, DeepSpeed's reentrant checkpoint",
                     {"pipeline": {"activation_checkpoint_interval": 1, "use_reentrant": True}}),
        PipelineMode("non_reentrant", "every block checkpointed, torch's non-reentrant checkpoint (ds_pipe_ckpt)",
                     {"pipeline": _NON_REENTRANT}),
        PipelineMode("selective", "non_reentrant, selective policy: keep matmul/attention outputs, recompute the rest",
                     {"pipeline": _NON_REENTRANT, "activation_checkpointing": {"policy": "selective"}}),
        PipelineMode("partitioned", "non_reentrant, partition_activations across a model-parallel group of 2",
                     {"pipeline": _NON_REENTRANT, "activation_checkpointing": {"partition_activations": True}}, mp=2),
        PipelineMode("cpu_offload", "non_reentrant, cpu_checkpointing (checkpoint inputs in host memory)",
                     {"pipeline": _NON_REENTRANT, "activation_checkpointing": {"cpu_checkpointing": True}}),
    )


def merge_config(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict:
    """``base`` with ``patch`` merged in, section by section (nested dicts
    merged, other values replaced); neither argument is modified."""
    merged = copy.deepcopy(dict(base))
    for key, value in patch.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_config(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


@dataclass(frozen=True)
class Preset:
    """Sizes of a run.

    Attributes:
        model: the GPT example's sizes.
        micro_batch: sequences per micro-batch.
        pipeline_depths: the ``pp`` values measured.
        accumulation_per_stage: gradient accumulation = this x pp (1F1B reaches its
            steady state, and every stage its largest number of micro-batches in
            flight, once there are at least 2 x pp micro-batches).
        warmup_steps: untimed steps per mode before memory is measured.
        timed_steps: timed steps per mode, taken round-robin over the modes.
    """

    model: GPTConfig
    micro_batch: int
    pipeline_depths: tuple[int, ...]
    accumulation_per_stage: int = 2
    warmup_steps: int = 1
    timed_steps: int = 5


# Wider and longer than the example's default model, so that a block's matmuls,
# not per-op overhead, set its time: selective checkpointing, which saves the
# matmuls' recomputation at the price of a Python call per op, only pays off
# there (4 blocks in one process, 1 thread: selective took 1.15 x full
# checkpointing's step time at d=64 x 64 tokens, 0.72 x and 0.90 x in two runs at
# d=128 x 128 tokens).
BENCHMARK_MODEL = GPTConfig(dim=128, context=128)

PRESETS = {
    "quick": Preset(BENCHMARK_MODEL, micro_batch=8, pipeline_depths=(2,), timed_steps=15),
    "full": Preset(BENCHMARK_MODEL, micro_batch=8, pipeline_depths=(2, 4), timed_steps=21),
}


@dataclass(frozen=True)
class Layout:
    """One pipeline topology and the modes it runs (those whose ``mp`` matches)."""

    pp: int
    mp: int
    modes: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return self.pp * self.mp


def layouts(preset: Preset, mode_list: Sequence[PipelineMode]) -> list[Layout]:
    """Every (pp, mp) topology of ``preset`` with the modes it runs, by pp then mp."""
    result = []
    for pp in preset.pipeline_depths:
        for mp in sorted({mode.mp for mode in mode_list}):
            names = tuple(mode.name for mode in mode_list if mode.mp == mp)
            if names:
                result.append(Layout(pp, mp, names))
    return result


def base_config(preset: Preset, pp: int) -> dict:
    """The DeepSpeed config every mode starts from at depth ``pp`` (data-parallel size 1)."""
    accumulation = preset.accumulation_per_stage * pp
    return {
        "train_micro_batch_size_per_gpu": preset.micro_batch,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": preset.micro_batch * accumulation,
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "torch_adam": True}},
    }


def micro_batches_in_flight(pp: int, stage: int, micro_batches: int) -> int:
    """Micro-batches whose forward state stage ``stage`` holds at once under
    DeepSpeed's 1F1B ``TrainSchedule``: ``min(pp - stage, micro_batches)``."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is not in [0, pp = {pp})")
    return min(pp - stage, micro_batches)
