"""Activation-checkpointing configuration: one immutable object, parsed and
validated from a DeepSpeed JSON config's sections or from keyword overrides.

What it is for: the ``pipeline`` and ``activation_checkpointing`` keys, the
fields they set, and every rule on their values (each with its one
``ConfigError`` text), the rules between a pipeline module's arguments and a
budget included (:func:`check_module_against_config`). What it must not do:
read a config file or string, or hold the settings in force; a config
document is read by :mod:`ds_pipe_ckpt.ds_config`, the settings in force are
:mod:`ds_pipe_ckpt.settings`'s.

Keys read (all optional):

``pipeline``
    ``use_reentrant`` (JSON boolean, default ``true``) and
    ``activation_checkpoint_interval`` (integer >= 0).
``activation_checkpointing``
    DeepSpeed's keys ``partition_activations``, ``contiguous_memory_optimization``,
    ``number_checkpoints``, ``cpu_checkpointing``, ``synchronize_checkpoint_boundary``,
    ``profile``, plus ours for the non-reentrant mode: ``policy`` (``"full"``,
    the default, or ``"selective"``: keep the outputs of matmuls, convolutions
    and attention and recompute the rest, see :mod:`ds_pipe_ckpt.selective`),
    ``save_ops`` (the ATen ops whose outputs ``"selective"`` keeps, replacing the
    default set), ``verify_recompute`` (compare each recomputation with its
    forward op by op, naming the first differing op), ``early_stop`` (torch's
    early stop of recomputation, default true: a recomputation ends once it has
    rebuilt every tensor the backward needs; false runs it to the end and
    requires the ops after that to match too), ``debug`` (torch's op-trace
    debug mode for recomputation errors) and ``memory_budget_mb`` (a per-stage
    memory budget, one number for every stage or a list with one per stage: the
    planner of :mod:`ds_pipe_ckpt.planning` then chooses per layer what to
    store, checkpoint or checkpoint selectively) or ``max_memory_mb`` (the same
    planner, under the total memory a stage's device may hold: one number, one
    per stage, or ``"auto"`` for a CUDA device's capacity less 10%); with a
    budget and ``PipelineModule(dynamic_shape=True)`` (micro-batches of
    variable length), ``max_sequence_length`` (the longest micro-batch the
    data gives, along ``sequence_dim`` of the stage's tensors, default 1:
    ``[batch, sequence, ...]``), which each stage plans every length up to,
    in ``length_buckets`` ranges (default 8; 1 plans once, for the longest).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ConfigError

__all__ = [
    "CheckpointingConfig",
    "check_module_against_config",
    "pipeline_interval",
    "validate_interval",
    "OVERRIDE_KEYS",
]

PIPELINE = "pipeline"
SECTION = "activation_checkpointing"

# DeepSpeed's keyword overrides of ``deepspeed.checkpointing.configure`` and
# ours, mapped to the field they set.
OVERRIDE_KEYS = {
    "partition_activations": "partition_activations",
    "contiguous_checkpointing": "contiguous_memory_optimization",
    "num_checkpoints": "number_checkpoints",
    "checkpoint_in_cpu": "cpu_checkpointing",
    "synchronize": "synchronize_checkpoint_boundary",
    "profile": "profile",
    "use_reentrant": "use_reentrant",
    "debug": "debug",
    "verify_recompute": "verify_recompute",
    "early_stop": "early_stop",
    "policy": "policy",
    "save_ops": "save_ops",
    "memory_budget_mb": "memory_budget_mb",
    "max_memory_mb": "max_memory_mb",
}

AUTO = "auto"

POLICIES = ("full", "selective")

# Micro-batches of variable length: the length ranges planned apart by default.
LENGTH_BUCKETS = 8
SEQUENCE_DIM_ALLOWED = ("an integer >= 0: the dimension of a stage's tensors that holds the sequence "
                        "(1 for [batch, sequence, ...], 0 for [sequence, batch, ...])")
LENGTH_BUCKETS_ALLOWED = ("a positive integer: how many length ranges up to max_sequence_length are planned "
                          "apart (1: one plan, made for the longest)")

NUMBER_CHECKPOINTS_ALLOWED = "a positive integer when contiguous_memory_optimization is true"


def require_int(key: str, value: Any, minimum: int, allowed: str) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``; else a
    ConfigError naming ``key`` with ``allowed``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, value, allowed)
    return value


def require_positive_int_or_none(key: str, value: Any) -> int | None:
    """``value`` if it is None or an int (not a bool) of at least 1; else a
    ConfigError naming ``key``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(key, value, "a positive integer or null")
    return value


def _require_bool(key: str, value: Any) -> bool:
    # bool is an int subclass and "false" is truthy: accept real booleans only.
    if not isinstance(value, bool):
        raise ConfigError(key, value, "a JSON boolean (true or false)",
                          "Strings such as \"false\" and numbers are not accepted.")
    return value


def validate_interval(key: str, value: Any) -> int:
    """Return ``value`` if it is a valid checkpoint interval (an int >= 0)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(key, value, "an integer >= 0 (0 disables activation checkpointing)",
                          upstream="assert interval >= 0")
    return value


@dataclass(frozen=True)
class CheckpointingConfig:
    """Validated activation-checkpointing settings.

    Field names follow DeepSpeed's ``activation_checkpointing`` JSON keys;
    ``use_reentrant`` mirrors ``pipeline.use_reentrant``.
    """

    use_reentrant: bool = True
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    cpu_checkpointing: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    verify_recompute: bool = False
    early_stop: bool = True
    debug: bool = False
    policy: str = "full"
    save_ops: tuple[str, ...] | None = None
    memory_budget_mb: float | tuple[float, ...] | None = None
    max_memory_mb: float | tuple[float, ...] | str | None = None
    max_sequence_length: int | None = None
    sequence_dim: int = 1
    length_buckets: int = LENGTH_BUCKETS

    def __post_init__(self):
        key_of = {f: (f"{PIPELINE}.{f}" if f == "use_reentrant" else f"{SECTION}.{f}")
                  for f in (x.name for x in dataclasses.fields(self))}
        for field in dataclasses.fields(self):
            if field.name not in ("number_checkpoints", "policy", "save_ops", "memory_budget_mb", "max_memory_mb",
                                  "max_sequence_length", "sequence_dim", "length_buckets"):
                _require_bool(key_of[field.name], getattr(self, field.name))
        self._check_policy(key_of)
        self._check_budget(key_of)
        self._check_lengths(key_of)
        n = require_positive_int_or_none(key_of["number_checkpoints"], self.number_checkpoints)
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise ConfigError(key_of["contiguous_memory_optimization"], True,
                              "false unless partition_activations is true",
                              "Contiguous buffers hold partitioned activations: set "
                              f"{SECTION}.partition_activations to true.",
                              upstream="Contiguous Checkpointing is only available with partitioned activations.")
        for key in ("debug", "verify_recompute"):
            if getattr(self, key) and self.use_reentrant:
                raise ConfigError(key_of[key], True, "false unless pipeline.use_reentrant is false",
                                  f"{key} checks torch's non-reentrant recomputation; "
                                  "set pipeline.use_reentrant to false to use it.")
        if self.contiguous_memory_optimization and n is None:
            raise ConfigError(key_of["number_checkpoints"], None,
                              NUMBER_CHECKPOINTS_ALLOWED,
                              "Set it to the number of checkpointed segments per micro-batch "
                              "(the buffers are sized from it).",
                              upstream="Must specify the number of layers with contiguous memory checkpointing")

    def _check_policy(self, key_of: dict[str, str]) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(key_of["policy"], self.policy, " or ".join(f'"{p}"' for p in POLICIES))
        if self.policy == "selective" and self.use_reentrant:
            raise ConfigError(key_of["policy"], self.policy, "\"full\" unless pipeline.use_reentrant is false",
                              "Selective checkpointing is built on torch's non-reentrant checkpoint; "
                              "set pipeline.use_reentrant to false to use it.")
        ops = self.save_ops
        if ops is None:
            return
        if isinstance(ops, str) or not isinstance(ops, (list, tuple)) or not ops:
            raise ConfigError(key_of["save_ops"], ops, "a non-empty list of ATen op names, e.g. [\"aten.mm\"]")
        if self.policy != "selective" and not self.plans:
            raise ConfigError(key_of["save_ops"], list(ops), f"null unless {key_of['policy']} is \"selective\" "
                              "or memory_budget_mb is set", "save_ops chooses what selective checkpointing keeps.")
        from .selective import resolve_ops  # imports torch's checkpoint internals: only when used
        resolve_ops(ops, key=key_of["save_ops"])
        object.__setattr__(self, "save_ops", tuple(ops))

    @property
    def plans(self) -> bool:
        """Whether the planner chooses what each stage checkpoints (a budget is set)."""
        return self.memory_budget_mb is not None or self.max_memory_mb is not None

    @property
    def budget_key(self) -> str:
        """The budget key in use, for messages."""
        return f"{SECTION}.{'max_memory_mb' if self.max_memory_mb is not None else 'memory_budget_mb'}"

    def _check_budget(self, key_of: dict[str, str]) -> None:
        if self.memory_budget_mb is not None and self.max_memory_mb is not None:
            raise ConfigError(key_of["max_memory_mb"], self.max_memory_mb, "null when memory_budget_mb is set",
                              "memory_budget_mb counts what a step adds to what is allocated when it begins; "
                              "max_memory_mb counts everything the stage's device holds: give one of them.")
        for name in ("memory_budget_mb", "max_memory_mb"):
            budget, key = getattr(self, name), key_of[name]
            if budget is None or (name == "max_memory_mb" and budget == AUTO):
                continue
            values = list(budget) if isinstance(budget, (list, tuple)) else [budget]
            if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 for v in values):
                allowed = ("a positive number of MiB (every stage), or a non-empty list of them (one per pipeline "
                           "stage)")
                raise ConfigError(key, budget, allowed + (', or "auto" (a CUDA device\'s capacity less 10%)'
                                                          if name == "max_memory_mb" else ""))
            if isinstance(budget, list):
                object.__setattr__(self, name, tuple(budget))
        if not self.plans:
            return
        key = self.budget_key
        budget = self.max_memory_mb if self.max_memory_mb is not None else self.memory_budget_mb
        _check_budget_mode(key, budget, self.use_reentrant)
        if self.policy == "selective":
            raise ConfigError(key_of["policy"], self.policy, f"\"full\" (the default) with {key.split('.')[1]}",
                              "With a budget the planner chooses, per segment, full or selective checkpointing "
                              "(save_ops still says what selective keeps).")

    def _check_lengths(self, key_of: dict[str, str]) -> None:
        length, dim = self.max_sequence_length, self.sequence_dim
        if length is not None:
            require_int(key_of["max_sequence_length"], length, 1,
                        "a positive integer: the longest micro-batch along sequence_dim, or null")
            if not self.plans:
                raise ConfigError(key_of["max_sequence_length"], length,
                                  "null unless memory_budget_mb or max_memory_mb is set",
                                  "It says which micro-batch lengths a memory budget must hold for.")
        require_int(key_of["sequence_dim"], dim, 0, SEQUENCE_DIM_ALLOWED)
        require_int(key_of["length_buckets"], self.length_buckets, 1, LENGTH_BUCKETS_ALLOWED)
        for name, default, meaning in (("sequence_dim", 1, "where max_sequence_length is measured"),
                                       ("length_buckets", LENGTH_BUCKETS, "how the lengths up to it are split")):
            if getattr(self, name) != default and length is None:
                raise ConfigError(key_of[name], getattr(self, name),
                                  f"{default} (the default) unless max_sequence_length is set", f"It says {meaning}.")

    @staticmethod
    def _of_stage(key: str, budget: Any, stage: int, num_stages: int) -> Any:
        if isinstance(budget, tuple):
            if len(budget) != num_stages:
                raise ConfigError(f"{SECTION}.{key}", list(budget),
                                  f"one number, or a list of {num_stages} (one per pipeline stage)")
            return budget[stage]
        return budget

    def budget_bytes(self, stage: int, num_stages: int) -> int | None:
        """``memory_budget_mb`` of pipeline stage ``stage``, in bytes (None: no such budget)."""
        budget = self._of_stage("memory_budget_mb", self.memory_budget_mb, stage, num_stages)
        return None if budget is None else int(budget * 2**20)

    def max_memory_bytes(self, stage: int, num_stages: int) -> int | str | None:
        """``max_memory_mb`` of pipeline stage ``stage``, in bytes, or ``"auto"`` (None: not set)."""
        budget = self._of_stage("max_memory_mb", self.max_memory_mb, stage, num_stages)
        return budget if budget is None or budget == AUTO else int(budget * 2**20)

    @classmethod
    def from_ds_config(cls, param_dict: Mapping[str, Any] | None) -> "CheckpointingConfig":
        """Parse the ``pipeline`` and ``activation_checkpointing`` sections."""
        return cls(**cls.named_in(param_dict))

    @classmethod
    def named_in(cls, param_dict: Mapping[str, Any] | None) -> dict[str, Any]:
        """The fields a DeepSpeed config's ``pipeline.use_reentrant`` and
        ``activation_checkpointing`` keys name, with their values (each checked
        where it can be alone: the types of ``use_reentrant`` and the interval,
        unknown keys; the whole is checked when a config is built from it)."""
        param_dict = {} if param_dict is None else param_dict
        if not isinstance(param_dict, Mapping):
            raise ConfigError("config", param_dict, "a dict parsed from the DeepSpeed JSON config")
        values: dict[str, Any] = {}
        pipeline = _section(param_dict, PIPELINE)
        if pipeline.get("use_reentrant") is not None:
            values["use_reentrant"] = _require_bool(f"{PIPELINE}.use_reentrant", pipeline["use_reentrant"])
        pipeline_interval(param_dict)  # validated here so that a bad value fails early

        checkpointing = _section(param_dict, SECTION)
        known = {f.name for f in dataclasses.fields(cls)} - {"use_reentrant"}
        for key, value in checkpointing.items():
            if key not in known:
                raise ConfigError(f"{SECTION}.{key}", value, f"one of the keys {sorted(known)}",
                                  "Unknown keys are rejected rather than silently ignored; check the spelling.")
            if value is not None or key == "number_checkpoints":
                values[key] = value
        return values

    @staticmethod
    def override_fields(**overrides: Any) -> dict[str, Any]:
        """``deepspeed.checkpointing.configure``-style keywords that are not
        ``None``, as the fields they set."""
        changes = {}
        for key, value in overrides.items():
            if key not in OVERRIDE_KEYS:
                raise TypeError(f"configure() got an unexpected keyword argument {key!r}; "
                                f"allowed: {sorted(OVERRIDE_KEYS)}")
            if value is not None:
                changes[OVERRIDE_KEYS[key]] = value
        return changes


def _check_budget_mode(key: str, budget: Any, use_reentrant: bool) -> None:
    if use_reentrant:
        raise ConfigError(key, budget, "null unless pipeline.use_reentrant is false",
                          "The planner checkpoints with torch's non-reentrant checkpoint (and selectively).")


def check_module_against_config(key: str, budget: Any, *, interval: int | None, dynamic_shape: bool,
                                use_reentrant: bool, max_sequence_length: int | None) -> None:
    """The rules between a pipeline module's own arguments and a memory budget.

    Args:
        key: the budget's key (``CheckpointingConfig.budget_key``), for messages.
        budget: the budget's value as configured, for messages.
        interval: the activation checkpoint interval in force (None: not set).
        dynamic_shape: whether the module is built with ``dynamic_shape=True``.
        use_reentrant: whether the module checkpoints in the reentrant mode.
        max_sequence_length: ``activation_checkpointing.max_sequence_length``.

    Raises:
        ConfigError: the reentrant mode, a nonzero interval, ``dynamic_shape``
            without ``max_sequence_length`` or ``max_sequence_length`` without it.
    """
    _check_budget_mode(key, budget, use_reentrant)
    if interval:
        raise ConfigError(f"{PIPELINE}.activation_checkpoint_interval", interval,
                          f"0 when {key} is set",
                          "The planner chooses which layers to checkpoint and where segments begin; set the "
                          f"interval to 0 (or drop {key.split('.')[1]} to checkpoint uniformly).")
    if dynamic_shape and max_sequence_length is None:
        raise ConfigError(f"{SECTION}.max_sequence_length", None,
                          f"the longest micro-batch (tokens) when {key} is set and the PipelineModule has "
                          "dynamic_shape=True",
                          "Micro-batches of variable length need the longest the data can give, so that the budget "
                          "holds for every one of them; set sequence_dim too if the sequence is not dimension 1 "
                          "of the tensors a stage receives.")
    if not dynamic_shape and max_sequence_length is not None:
        raise ConfigError(f"{SECTION}.max_sequence_length", max_sequence_length,
                          "null unless the PipelineModule is built with dynamic_shape=True",
                          "Without dynamic_shape DeepSpeed's engine sends one shape for every micro-batch.")


def _section(param_dict: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = param_dict.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(name, value, "a JSON object")
    return value


def pipeline_interval(param_dict: Mapping[str, Any] | None) -> int | None:
    """The configured ``pipeline.activation_checkpoint_interval``, validated, or None."""
    pipeline = _section(param_dict or {}, PIPELINE)
    if "activation_checkpoint_interval" not in pipeline:
        return None
    return validate_interval(f"{PIPELINE}.activation_checkpoint_interval",
                             pipeline["activation_checkpoint_interval"])
