"""``initialize()``: ``deepspeed.initialize`` plus activation-checkpointing
configuration from the same JSON config."""

from __future__ import annotations

import logging
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule as _DSPipelineModule
from deepspeed.runtime.pipe.engine import PipelineEngine

from . import clipping
from .compat import resolve_use_reentrant
from .config import CheckpointingConfig, check_module_against_config, pipeline_interval
from .ds_config import load_ds_config
from .errors import ConfigError
from .gradient_accumulation import correct_gradient_accumulation
from .settings import configure_job

__all__ = ["initialize"]

logger = logging.getLogger("ds_pipe_ckpt")


def _resolve_config(args: Any, config: Any, config_params: Any) -> dict:
    # Same precedence as deepspeed.initialize: config, then config_params,
    # then args.deepspeed_config.
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    return load_ds_config(config)


def initialize(args: Any = None,
               model: Any = None,
               optimizer: Any = None,
               model_parameters: Any = None,
               training_data: Any = None,
               lr_scheduler: Any = None,
               distributed_port: int = deepspeed.TORCH_DISTRIBUTED_DEFAULT_PORT,
               mpu: Any = None,
               dist_init_required: bool | None = None,
               collate_fn: Any = None,
               config: Any = None,
               mesh_param: Any = None,
               config_params: Any = None):
    """``deepspeed.initialize`` (same arguments, same return value:
    ``(engine, optimizer, training_dataloader, lr_scheduler)``) that also
    validates and applies the config's activation-checkpointing settings, with
    the pipeline grid of a :class:`PipelineModule` as model-parallel unit.

    A pipeline engine gets the gradients of the same layers without a
    pipeline, on every DeepSpeed in the supported range: divided by
    ``gradient_accumulation_steps`` once, as DeepSpeed 0.19 does
    (:func:`ds_pipe_ckpt.gradient_accumulation.correct_gradient_accumulation`), and, with
    ``gradient_clipping`` on the fp32 path, clipped by the norm over every
    stage (:mod:`ds_pipe_ckpt.clipping`).

    With ``activation_checkpointing.memory_budget_mb`` (or ``max_memory_mb``) and a
    :class:`~ds_pipe_ckpt.PipelineModule`, the module's planner is enabled
    (``PipelineModule.enable_planning``) with the engine's micro-batches per step.

    Raises:
        ConfigError: before anything is built, for an invalid
            ``pipeline.use_reentrant``, ``pipeline.activation_checkpoint_interval``
            or ``activation_checkpointing`` value; after the engine is built, on
            every rank, for a ``gradient_accumulation_steps`` this DeepSpeed
            scales in a way that cannot be corrected.
    """
    param_dict = _resolve_config(args, config, config_params)
    # Validate before any process group or engine is built, so that a bad value
    # fails fast and names its key.
    checkpointing = CheckpointingConfig.from_ds_config(param_dict)
    if checkpointing.plans:
        _check_plannable(model, param_dict, checkpointing.budget_key)
    _check_partition(model, param_dict)
    if isinstance(model, _DSPipelineModule):
        from .pipe import ENGINE_CORRECTED
        model.__dict__[ENGINE_CORRECTED] = True  # before the engine first trains it
    result = deepspeed.initialize(args=args,
                                  model=model,
                                  optimizer=optimizer,
                                  model_parameters=model_parameters,
                                  training_data=training_data,
                                  lr_scheduler=lr_scheduler,
                                  distributed_port=distributed_port,
                                  mpu=mpu,
                                  dist_init_required=dist_init_required,
                                  collate_fn=collate_fn,
                                  config=config,
                                  mesh_param=mesh_param,
                                  config_params=config_params)
    if isinstance(result[0], PipelineEngine):
        _correct_pipeline_engine(result[0])
    if isinstance(model, _DSPipelineModule):
        resolve_use_reentrant(model, param_dict)
        if mpu is None:
            mpu = model.mpu()
    settings = configure_job(param_dict, mpu)
    if settings.config.plans:
        engine, stage, stages = result[0], model.stage_id, model.num_stages
        model.enable_planning(settings.config.budget_bytes(stage, stages), engine.micro_batches,
                              known_buffers=_known_buffers(engine),
                              max_memory_bytes=settings.config.max_memory_bytes(stage, stages),
                              max_sequence_length=settings.config.max_sequence_length,
                              sequence_dim=settings.config.sequence_dim,
                              length_buckets=settings.config.length_buckets)
    return result


def _correct_pipeline_engine(engine: PipelineEngine) -> None:
    """The engine's gradient accumulation scale and fp32 clipping norm made the
    model's without a pipeline; an engine that cannot be corrected stops every rank."""
    error = note = None
    try:
        note = correct_gradient_accumulation(engine)
    except ConfigError as raised:
        error = raised
    _raise_on_every_rank(error)
    if not clipping.install(engine) and engine.gradient_clipping() > 0:
        logger.warning("ds_pipe_ckpt: the model has mixture-of-experts layers; DeepSpeed's fp32 gradient clipping "
                       "is left as it is, and on a pipeline it measures stage 0's gradients only (see "
                       "ds_pipe_ckpt.clipping). bf16 or ZeRO stage 1 clip by the whole model's norm.")
    if note is not None and engine.grid.get_data_parallel_rank() == 0 and engine.grid.get_slice_parallel_rank() == 0:
        logger.warning("ds_pipe_ckpt: %s.", note)


def _raise_on_every_rank(error: ConfigError | None) -> None:
    """Raise ``error`` here and the lowest failing rank's on every other rank,
    so that no rank goes on into a step whose peers stopped."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if error is not None:
            raise error
        return
    shared: list = [None] * dist.get_world_size()
    dist.all_gather_object(shared, None if error is None else (error.key, error.value, error.allowed, error.hint))
    if error is not None:
        raise error
    first = next((fields for fields in shared if fields is not None), None)
    if first is not None:
        key, value, allowed, hint = first
        raise ConfigError(key, value, allowed, f"{hint} (Raised by another rank; every rank stops here.)")


def _known_buffers(engine: Any) -> tuple:
    """The big buffers outside the activations that the engine allocates in every
    step, as far as it tells: ZeRO stage 1 and 2's reduce bucket, which a
    pipeline allocates in every backward, one per gradient dtype (DeepSpeed's
    ``ipg_buckets``; float32 where the optimizer does not show them: the
    gradient accumulation type under bf16)."""
    from .planning.stage_problem import KnownBuffer  # the planner is optional machinery

    stage = engine.zero_optimization_stage()
    if stage not in (1, 2):
        return ()
    elements = int(engine.zero_reduce_bucket_size())
    dtypes = list(getattr(getattr(engine, "optimizer", None), "ipg_buckets", None) or [torch.float32])
    size = elements * sum(torch.empty((), dtype=dtype).element_size() for dtype in dtypes)
    names = ", ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
    return (KnownBuffer(f"ZeRO stage {stage}'s reduce bucket (zero_optimization.reduce_bucket_size = {elements} "
                        f"elements of {names})", size,
                        "a smaller zero_optimization.reduce_bucket_size lowers it, e.g. 5e7"),)


def _check_partition(model: Any, param_dict: dict) -> None:
    """``pipeline.partition_method`` and ``pipeline.partition_profile`` are read
    when the module is built (``partition_from_config``): a config that names
    a method the module was not cut with would otherwise be silently ignored."""
    from .pipe import PipelineModule

    pipeline = param_dict.get("pipeline") or {}
    method = pipeline.get("partition_method")
    if method is None:
        if pipeline.get("partition_profile") is not None:
            raise ConfigError("pipeline.partition_profile", pipeline["partition_profile"],
                              "null unless pipeline.partition_method is \"planned\"",
                              "Only the planned partition profiles the layers.")
        return
    built = model.partition_method if isinstance(model, PipelineModule) else None
    if not isinstance(method, str) or built is None or built.lower() != method.lower():
        raise ConfigError("pipeline.partition_method", method,
                          f"the method the PipelineModule was cut with ({built!r})" if built is not None else
                          "null unless the model is a ds_pipe_ckpt.PipelineModule",
                          "DeepSpeed cuts the stages when the module is built, before this config is read: "
                          "build it with ds_pipe_ckpt.partition_from_config(config, sample=..., labels=...), "
                          "which reads this key.")


def _check_plannable(model: Any, param_dict: dict, key: str) -> None:
    from .pipe import PipelineModule  # the module imports this package's core

    if not isinstance(model, PipelineModule):
        raise ConfigError(key, param_dict["activation_checkpointing"][key.split(".")[1]],
                          "null unless the model is a ds_pipe_ckpt.PipelineModule",
                          "The planner chooses what each pipeline stage checkpoints.")
    section = param_dict["activation_checkpointing"]
    # CheckpointingConfig.from_ds_config has refused a budget with the reentrant mode.
    check_module_against_config(key, section[key.split(".")[1]], interval=pipeline_interval(param_dict),
                                dynamic_shape=model.dynamic_shape, use_reentrant=False,
                                max_sequence_length=section.get("max_sequence_length"))
