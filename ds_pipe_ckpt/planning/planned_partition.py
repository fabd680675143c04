"""``PipelineModule(partition_method="planned")``: the stage boundaries the
stage-boundary planner (:mod:`.partition`) chooses from a profile of the
layer list (:mod:`.layer_profiling`).

DeepSpeed cuts the stages in ``PipelineModule.__init__``, before
``deepspeed.initialize`` and its JSON config exist, so what the cut needs is
given to the module as a :class:`PartitionPlanning`, built in code or read
from the same JSON config (:meth:`PartitionPlanning.from_config`). The first rank profiles
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

import torch
import torch.distributed as dist

from ..config import SECTION, CheckpointingConfig
from ..ds_config import load_ds_config, micro_batches_per_step
from ..errors import ConfigError
from .problem import LayerProfile
from .layer_profiling import LayerChainProfile, profile_layer_specs
from .partition import InfeasiblePartitionError, PartitionPlan, plan_partition

__all__ = ["PartitionPlanning", "partition_from_config", "planned_partition", "partition_table", "PROFILE_FORMAT"]

MIB = 2**20
PROFILE_FORMAT = "ds_pipe_ckpt.layer_profile.v2"
PROFILE_KEY = "pipeline.partition_profile"


@dataclass(frozen=True)
class PartitionPlanning:
    """What ``partition_method="planned"`` needs.

    Attributes:
        memory_budget_mb: each stage's budget, as ``activation_checkpointing.memory_budget_mb``
            (MiB above what a step begins with): one number for every stage, or one per stage.
        micro_batches: micro-batches per step (the engine's gradient accumulation steps);
            None: derived as DeepSpeed derives it, from ``train_batch_size`` and
            ``train_micro_batch_size_per_gpu`` and the data-parallel size of the
            module's topology.
        sample: one micro-batch's input to the first layer, as the data loader gives it
            (a tensor or a tuple); needed unless ``profile_path`` holds a saved profile.
        labels: that micro-batch's labels: with them the module's ``loss_fn`` is
            profiled too (its time and what it saves, on the last stage); without
            them the loss is left out of the model (fine for a small vocabulary).
        profile_path: a JSON file: read when it exists and describes the same layer
            list (and, when a sample is given, the same micro-batch shapes), else
            written by the first rank after profiling, so that a restarted job
            does not profile again. A different number of stages, budget or
            micro-batch count re-plans from the same profile.
        device: where the layers are profiled (default: the sample's device).
        train_batch_size, train_micro_batch_size_per_gpu: the DeepSpeed keys,
            from which ``micro_batches`` is derived when it is None.
    """

    memory_budget_mb: float | Sequence[float]
    micro_batches: int | None = None
    sample: Any = None
    labels: Any = None
    profile_path: str | None = None
    device: str | None = None
    budget_key: str = "partition_planning.memory_budget_mb"  # how messages name the budget
    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None

    @classmethod
    def from_config(cls, config: Any, sample: Any = None, labels: Any = None,
                    device: str | None = None) -> "PartitionPlanning":
        """The planning a DeepSpeed JSON config asks for (a dict, a path or
        base64, as ``deepspeed.initialize`` takes it), so that the cut and each
        stage's checkpointing plan are planned under the same budget:

        * ``activation_checkpointing.memory_budget_mb``: each stage's budget;
        * ``gradient_accumulation_steps``: the micro-batches per step, or
          ``train_batch_size`` and ``train_micro_batch_size_per_gpu``, from
          which DeepSpeed derives it with the data-parallel size (derived
          when the module's topology is known);
        * ``pipeline.partition_profile`` (optional): where the profile is kept.

        Raises:
            ConfigError: a missing or invalid key (named), or
                ``max_memory_mb`` (the cut needs budgets above a step's start,
                which is not known before the engine exists).
        """
        param_dict = load_ds_config(config)
        settings = CheckpointingConfig.from_ds_config(param_dict)
        if settings.max_memory_mb is not None:
            raise ConfigError(f"{SECTION}.max_memory_mb", settings.max_memory_mb,
                              f"null with partition_method \"planned\": give {SECTION}.memory_budget_mb",
                              "The stages are cut before the engine exists, so what a step begins with "
                              "(parameters, optimizer state) is not known yet; memory_budget_mb counts "
                              "what a step adds to it.")
        if settings.memory_budget_mb is None:
            raise ConfigError(f"{SECTION}.memory_budget_mb", None,
                              "each stage's budget in MiB (one number, or one per stage)",
                              "partition_method \"planned\" cuts the stages so that each fits its budget, "
                              "and the per-stage planner keeps it at run time.")
        accumulation = param_dict.get("gradient_accumulation_steps")
        if accumulation is not None and (isinstance(accumulation, bool) or not isinstance(accumulation, int)
                                         or accumulation < 1):
            raise ConfigError("gradient_accumulation_steps", accumulation, "a positive int or null")
        pipeline = param_dict.get("pipeline") or {}
        profile_path = pipeline.get("partition_profile")
        if profile_path is not None and not isinstance(profile_path, str):
            raise ConfigError(PROFILE_KEY, profile_path, "a file path (a string) or null")
        budget = settings.memory_budget_mb
        planning = cls(memory_budget_mb=list(budget) if isinstance(budget, tuple) else budget,
                   micro_batches=accumulation, sample=sample, labels=labels, profile_path=profile_path,
                   device=device, budget_key=f"{SECTION}.memory_budget_mb",
                   train_batch_size=param_dict.get("train_batch_size"),
                   train_micro_batch_size_per_gpu=param_dict.get("train_micro_batch_size_per_gpu"))
        if accumulation is None:
            planning.micro_batches_for(None)  # the keys checked now; derived once the topology is known
        return planning

    def micro_batches_for(self, data_parallel_size: int | None) -> int | None:
        """The micro-batches per step: ``micro_batches``, or derived from the
        batch sizes as DeepSpeed derives ``gradient_accumulation_steps``
        (``data_parallel_size`` None: only check that they can be; returns None).

        Raises:
            ConfigError: neither is given, or they do not multiply out."""
        if self.micro_batches is not None:
            if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) \
                    or self.micro_batches < 1:
                raise ConfigError("partition_planning.micro_batches", self.micro_batches, "a positive int")
            return self.micro_batches
        batch = {"train_batch_size": self.train_batch_size,
                 "train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu}
        if all(value is None for value in batch.values()):
            raise ConfigError("gradient_accumulation_steps", None,
                              "a positive int, or train_batch_size and train_micro_batch_size_per_gpu",
                              "partition_method \"planned\" needs the micro-batches per step: each stage "
                              "holds min(stages - stage, micro-batches) of them at once under 1F1B.")
        return micro_batches_per_step(batch, data_parallel_size)

    def budgets_bytes(self, stages: int) -> tuple[int, ...]:
        """The budget of each stage in bytes. Raises ConfigError naming the value."""
        key = self.budget_key
        values = (list(self.memory_budget_mb) if isinstance(self.memory_budget_mb, (list, tuple))
                  else [self.memory_budget_mb] * stages)
        if len(values) != stages:
            raise ConfigError(key, self.memory_budget_mb, f"one number, or one per stage ({stages})")
        for value in values:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(key, self.memory_budget_mb, "positive numbers of MiB")
        return tuple(int(value * MIB) for value in values)


def partition_from_config(config: Any, default: str = "parameters", sample: Any = None, labels: Any = None,
                          device: str | None = None) -> tuple[str, PartitionPlanning | None]:
    """``PipelineModule``'s ``partition_method`` and ``partition_planning`` from
    the DeepSpeed JSON config's ``pipeline.partition_method`` (``default`` when
    absent): a DeepSpeed method (``"parameters"``, ``"uniform"``,
    ``"type:..."``) with no planning, or ``"planned"`` with
    :meth:`PartitionPlanning.from_config` on ``sample`` and ``labels`` (one
    micro-batch, as the data loader gives it)::

        method, planning = partition_from_config(args.deepspeed_config, sample=x, labels=y)
        module = PipelineModule(layers, num_stages=pp, loss_fn=loss, partition_method=method,
                                partition_planning=planning)

    Raises:
        ConfigError: ``pipeline.partition_method`` not a string, or a planning key
            missing or invalid (named).
    """
    param_dict = load_ds_config(config)
    pipeline = param_dict.get("pipeline") or {}
    method = pipeline.get("partition_method", default)
    if not isinstance(method, str) or not method:
        raise ConfigError("pipeline.partition_method", method,
                          "\"parameters\", \"uniform\", \"type:REGEX\" (DeepSpeed's) or \"planned\"")
    if method.lower() != "planned":
        return method, None
    return method, PartitionPlanning.from_config(param_dict, sample=sample, labels=labels, device=device)


def _shapes(value: Any) -> list | None:
    """The shapes and dtypes of a sample or its labels, as saved with the profile."""
    if value is None:
        return None
    values = value if isinstance(value, (tuple, list)) else (value, )
    return [[list(v.shape), str(v.dtype)] if isinstance(v, torch.Tensor) else type(v).__name__ for v in values]


def _chain_to_json(chain: LayerChainProfile, names: list[str], planning: PartitionPlanning) -> dict:
    return {"format": PROFILE_FORMAT, "layer_types": names,
            "sample": _shapes(planning.sample), "labels": _shapes(planning.labels),
            "layers": [dataclasses.asdict(layer) for layer in chain.layers],
            "backward_s": list(chain.backward_s), "output_bytes": chain.output_bytes,
            "loss_s": chain.loss_s, "loss_saved_bytes": chain.loss_saved_bytes}


def _chain_from_json(data: dict) -> LayerChainProfile:
    return LayerChainProfile(layers=tuple(LayerProfile(**layer) for layer in data["layers"]),
                             backward_s=tuple(data["backward_s"]), output_bytes=data["output_bytes"],
                             loss_s=data["loss_s"], loss_saved_bytes=data["loss_saved_bytes"])


def _stale(data: dict, names: list[str], planning: PartitionPlanning) -> str | None:
    """Why a saved profile does not describe this layer list and micro-batch, or None."""
    if data.get("format") != PROFILE_FORMAT:
        return f"is of format {data.get('format')!r}, not {PROFILE_FORMAT!r}"
    if data.get("layer_types") != names:
        return "describes other layers"
    for field in ("sample", "labels"):
        given = _shapes(getattr(planning, field))
        if given is not None and data.get(field) != given:
            return f"was measured on a {field} of {data.get(field)}, not {given}"
    return None


def _first_rank_chain(specs: Sequence[Any], names: list[str], planning: PartitionPlanning,
                      loss_fn: Any) -> tuple[dict, str]:
    """The profile as JSON, and where it came from."""
    path = Path(planning.profile_path) if planning.profile_path else None
    if path is not None and path.exists():
        data = json.loads(path.read_text())
        stale = _stale(data, names, planning)
        if stale is None:
            return data, f"read from {path}"
        note = f"{path} {stale}; profiled again and rewritten"
    else:
        note = "profiled" + (f" and saved to {path}" if path is not None else "")
    if planning.sample is None:
        raise ConfigError("partition_planning.sample", None, "one micro-batch's input to the first layer",
                          "partition_method=\"planned\" profiles the layers on it"
                          + (f"; {path} holds no profile of these layers" if path is not None else ""))
    chain = profile_layer_specs(specs, planning.sample, device=planning.device, loss_fn=loss_fn,
                                labels=planning.labels)
    data = _chain_to_json(chain, names, planning)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
    return data, note


def planned_partition(specs: Sequence[Any], names: list[str], stages: int, planning: PartitionPlanning,
                      loss_fn: Any = None, data_parallel_size: int = 1) -> tuple[PartitionPlan, LayerChainProfile, str]:
    """The cut of ``specs`` into ``stages`` (module docstring); the same on
    every rank. ``loss_fn`` (the module's) is profiled when the planning has
    labels. Returns the plan, the profile and where the profile came from.

    Raises:
        ConfigError: a budget, micro-batch count or sample that is missing or
            invalid, or a budget no cut fits (each stage's least budget named).
    """
    budgets = planning.budgets_bytes(stages)
    micro_batches = planning.micro_batches_for(data_parallel_size)
    message: list[Any] = [None, None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        message = list(_first_rank_chain(specs, names, planning, loss_fn))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(message, src=0)
    data, note = message
    chain = _chain_from_json(data)
    try:
        plan = plan_partition(chain.partition_problem(stages, micro_batches, budgets))
    except InfeasiblePartitionError as error:
        reason = str(error)
        raise ConfigError(planning.budget_key, planning.memory_budget_mb, "a budget some cut of the layers fits",
                          f"{reason[:1].upper()}{reason[1:]}. Raise the budget, lower the micro-batch size, or use more "
                          "stages.") from error
    budget_text = ", ".join(f"{b / MIB:.2f}" for b in budgets)
    return plan, chain, (f"{note}; planned for {stages} stages, {micro_batches} micro-batches per step, "
                         f"budgets {budget_text} MiB")


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
