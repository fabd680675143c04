"""``initialize()``: ``deepspeed.initialize`` plus activation-checkpointing
configuration from the same JSON config."""

from __future__ import annotations

from typing import Any

import deepspeed
from deepspeed.pipe import PipelineModule as _DSPipelineModule

from .config import CheckpointingConfig, load_ds_config
from .settings import configure

__all__ = ["initialize"]


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

    Raises:
        ConfigError: before anything is built, for an invalid
            ``pipeline.use_reentrant``, ``pipeline.activation_checkpoint_interval``
            or ``activation_checkpointing`` value.
    """
    param_dict = _resolve_config(args, config, config_params)
    # Validate before any process group or engine is built, so that a bad value
    # fails fast and names its key.
    CheckpointingConfig.from_ds_config(param_dict)
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
    if mpu is None and isinstance(model, _DSPipelineModule):
        mpu = model.mpu()
    configure(mpu=mpu, deepspeed_config=param_dict)
    return result
