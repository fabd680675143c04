"""The DeepSpeed config as a document: the forms ``deepspeed.initialize``
accepts it in (a dict, a JSON/HJSON file, a base64 string), its sections, and
the micro-batches per step DeepSpeed derives from its batch keys.

What it is for: turning whatever a program passes as ``config`` into a dict,
and reading the batch keys DeepSpeed itself owns. What it must not do: read
the ``pipeline`` and ``activation_checkpointing`` sections or write their
rules; those are :class:`~ds_pipe_ckpt.config.CheckpointingConfig`'s
(:mod:`ds_pipe_ckpt.config`), whose value rules it calls.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any, Mapping

from .config import require_positive_int_or_none
from .errors import ConfigError

__all__ = ["load_ds_config", "micro_batches_per_step"]


def load_ds_config(config: Any) -> dict:
    """Read a DeepSpeed config the way ``deepspeed.initialize`` accepts it:
    a dict, a path to a JSON/HJSON file, or a urlsafe-base64-encoded JSON string."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.exists(path):
            import hjson  # DeepSpeed's own config reader; a dependency of deepspeed
            with open(path) as handle:
                return dict(hjson.load(handle))
        try:
            return json.loads(base64.urlsafe_b64decode(path).decode("utf-8"))
        except (binascii.Error, UnicodeDecodeError, ValueError):
            pass
    raise ConfigError("deepspeed_config", config,
                      "a dict, a path to an existing JSON file, or a base64-encoded JSON string")


def _batch_value(param_dict: Mapping[str, Any], key: str) -> int | None:
    return require_positive_int_or_none(key, param_dict.get(key))


def micro_batches_per_step(param_dict: Mapping[str, Any], data_parallel_size: int | None) -> int | None:
    """The micro-batches per step (``gradient_accumulation_steps``) of a
    DeepSpeed config, given or derived as DeepSpeed derives it from
    ``train_batch_size`` and ``train_micro_batch_size_per_gpu`` and the
    data-parallel size (``train_batch_size = micro x accumulation x data
    parallel``; 1 when only one of the two batch sizes is given).
    ``data_parallel_size`` None (not known yet): the keys are checked and None
    is returned unless ``gradient_accumulation_steps`` is given.

    Raises:
        ConfigError: a batch key that is not a positive integer, none of the
            three keys, or values that do not multiply out (named as DeepSpeed's
            own check names them).
    """
    if data_parallel_size is not None and (isinstance(data_parallel_size, bool)
                                           or not isinstance(data_parallel_size, int) or data_parallel_size < 1):
        raise ValueError(f"data_parallel_size must be a positive int, got {data_parallel_size!r}")
    train = _batch_value(param_dict, "train_batch_size")
    micro = _batch_value(param_dict, "train_micro_batch_size_per_gpu")
    accumulation = _batch_value(param_dict, "gradient_accumulation_steps")
    if accumulation is None:
        if train is None and micro is None:
            raise ConfigError("train_batch_size", None,
                              "a positive integer (or train_micro_batch_size_per_gpu), as DeepSpeed requires",
                              "The micro-batches per step are gradient_accumulation_steps, given or derived "
                              "from train_batch_size and train_micro_batch_size_per_gpu.")
        if data_parallel_size is None:
            return None
        accumulation = 1 if train is None or micro is None else train // micro // data_parallel_size
    if data_parallel_size is None:
        return accumulation
    if train is not None and micro is not None and train != micro * accumulation * data_parallel_size:
        raise ConfigError("train_batch_size", train,
                          f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size "
                          f"= {micro} x {accumulation} x {data_parallel_size}",
                          upstream="Check batch related parameters. train_batch_size is not equal to "
                          "micro_batch_per_gpu * gradient_acc_step * world_size")
    if accumulation < 1:
        raise ConfigError("gradient_accumulation_steps", accumulation,
                          "at least 1: train_batch_size must be at least train_micro_batch_size_per_gpu x "
                          f"the data-parallel size ({data_parallel_size})")
    return accumulation
