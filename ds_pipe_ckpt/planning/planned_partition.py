"""``PipelineModule(partition_method="planned")``: the stage boundaries the
stage-boundary planner (:mod:`.partition`) chooses from a profile of the
layer list (:mod:`.layer_profiling`).

DeepSpeed cuts the stages in ``PipelineModule.__init__``, before
``deepspeed.initialize`` and its JSON config exist, so what the cut needs is
given to the module as a :class:`PartitionPlanning`. The first rank profiles
(or reads a saved profile) and sends the profile to every rank, which all
solve the same problem and so agree on the cut. The per-stage planner
(``activation_checkpointing.memory_budget_mb``) then plans each stage at run
time from its own measurements, and keeps the budget as always.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch.distributed as dist

from ..errors import ConfigError
from .cost_model import LayerProfile
from .layer_profiling import LayerChainProfile, profile_layer_specs
from .partition import PartitionPlan, plan_partition

__all__ = ["PartitionPlanning", "planned_partition", "partition_table", "PROFILE_FORMAT"]

MIB = 2**20
PROFILE_FORMAT = "ds_pipe_ckpt.layer_profile.v1"


@dataclass(frozen=True)
class PartitionPlanning:
    """What ``partition_method="planned"`` needs.

    Attributes:
        memory_budget_mb: each stage's budget, as ``activation_checkpointing.memory_budget_mb``
            (MiB above what a step begins with): one number for every stage, or one per stage.
        micro_batches: micro-batches per step (the engine's gradient accumulation steps).
        sample: one micro-batch's input to the first layer, as the data loader gives it
            (a tensor or a tuple); needed unless ``profile_path`` holds a saved profile.
        profile_path: a JSON file: read when it exists and matches the layer list,
            else written by the first rank after profiling, so that a restarted job
            does not profile again.
        device: where the layers are profiled (default: the sample's device).
    """

    memory_budget_mb: float | Sequence[float]
    micro_batches: int
    sample: Any = None
    profile_path: str | None = None
    device: str | None = None

    def budgets_bytes(self, stages: int) -> tuple[int, ...]:
        """The budget of each stage in bytes. Raises ConfigError naming the value."""
        key = "partition_planning.memory_budget_mb"
        values = (list(self.memory_budget_mb) if isinstance(self.memory_budget_mb, (list, tuple))
                  else [self.memory_budget_mb] * stages)
        if len(values) != stages:
            raise ConfigError(key, self.memory_budget_mb, f"one number, or one per stage ({stages})")
        for value in values:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(key, self.memory_budget_mb, "positive numbers of MiB")
        return tuple(int(value * MIB) for value in values)


def _chain_to_json(chain: LayerChainProfile, names: list[str]) -> dict:
    return {"format": PROFILE_FORMAT, "layer_types": names,
            "layers": [dataclasses.asdict(layer) for layer in chain.layers],
            "backward_s": list(chain.backward_s), "output_bytes": chain.output_bytes}


def _chain_from_json(data: dict, names: list[str]) -> LayerChainProfile | None:
    """The saved profile, or None when it is not of this layer list."""
    if data.get("format") != PROFILE_FORMAT or data.get("layer_types") != names:
        return None
    return LayerChainProfile(layers=tuple(LayerProfile(**layer) for layer in data["layers"]),
                             backward_s=tuple(data["backward_s"]), output_bytes=data["output_bytes"])


def _first_rank_chain(specs: Sequence[Any], names: list[str], planning: PartitionPlanning) -> tuple[dict, str]:
    """The profile as JSON, and where it came from."""
    path = Path(planning.profile_path) if planning.profile_path else None
    if path is not None and path.exists():
        data = json.loads(path.read_text())
        if _chain_from_json(data, names) is not None:
            return data, f"read from {path}"
        note = f"{path} holds a profile of other layers; profiled again and rewritten"
    else:
        note = "profiled" + (f" and saved to {path}" if path is not None else "")
    if planning.sample is None:
        raise ConfigError("partition_planning.sample", None, "one micro-batch's input to the first layer",
                          "partition_method=\"planned\" profiles the layers on it"
                          + (f"; {path} holds no profile of these layers" if path is not None else ""))
    chain = profile_layer_specs(specs, planning.sample, device=planning.device)
    data = _chain_to_json(chain, names)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
    return data, note


def planned_partition(specs: Sequence[Any], names: list[str], stages: int,
                      planning: PartitionPlanning) -> tuple[PartitionPlan, LayerChainProfile, str]:
    """The cut of ``specs`` into ``stages`` (module docstring); the same on
    every rank. Returns the plan, the profile and where the profile came from.

    Raises:
        ConfigError: a budget, micro-batch count or sample that is missing or invalid.
        InfeasiblePartitionError: no cut fits every stage's budget.
    """
    budgets = planning.budgets_bytes(stages)
    if isinstance(planning.micro_batches, bool) or not isinstance(planning.micro_batches, int) \
            or planning.micro_batches < 1:
        raise ConfigError("partition_planning.micro_batches", planning.micro_batches, "a positive int")
    message: list[Any] = [None, None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        message = list(_first_rank_chain(specs, names, planning))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(message, src=0)
    data, note = message
    chain = _chain_from_json(data, names)
    plan = plan_partition(chain.partition_problem(stages, planning.micro_batches, budgets))
    return plan, chain, note


def partition_table(plan: PartitionPlan, names: list[str], note: str) -> str:
    """The cut as a markdown table: stage, layers, predicted time per micro-batch and peak."""
    lines = ["ds_pipe_ckpt planned partition (stage boundaries chosen with each stage's checkpointing):", "",
             "| stage | layers | time / micro-batch ms | predicted peak MiB | recompute ms |",
             "|---:|---|---:|---:|---:|"]
    for stage, ((start, end), seconds, stage_plan) in enumerate(zip(plan.stage_layers, plan.stage_seconds,
                                                                    plan.stage_plans)):
        lines.append(f"| {stage} | {start}-{end - 1} ({', '.join(names[start:end])}) | {seconds * 1e3:.2f} "
                     f"| {stage_plan.predicted_peak_bytes / MIB:.2f} | {stage_plan.recompute_s * 1e3:.2f} |")
    lines += ["", f"Modelled 1F1B step: {plan.step_seconds * 1e3:.2f} ms (profile {note})."]
    return "\n".join(lines)
