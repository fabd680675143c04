"""The activation-checkpointing settings in force, held in one object, and
where they come from.

Three sources, in rising precedence, each replaced as a whole by its next call:

1. the defaults (:class:`~ds_pipe_ckpt.CheckpointingConfig`'s);
2. the job's JSON config: the keys its ``pipeline.use_reentrant`` and
   ``activation_checkpointing`` name, as ``ds_pipe_ckpt.initialize`` reads
   them (or, for ``use_reentrant``, as DeepSpeed's engine gives it to a
   :class:`~ds_pipe_ckpt.PipelineModule`), with the pipeline grid as ``mpu``;
3. the program's latest configure call in code, :func:`configure` or
   ``deepspeed.checkpointing.configure`` alike: the keys its
   ``deepspeed_config`` names, then its keywords that are not ``None``, and
   its ``mpu`` (``deepspeed.checkpointing.configure`` keeps an earlier call's
   when given ``None``, as DeepSpeed does).

So ``initialize`` never undoes what a program configured, and a configure
call after it keeps the JSON's keys the call does not name. Where the JSON
and the program disagree the log says once which value is in force. The
order is written once, :meth:`ConfigSources.in_rising_precedence`; the
config, the ``mpu`` and the conflict notes all read it.

The settings in force are process-wide, as DeepSpeed's checkpointing
configuration is: one :class:`SettingsInForce` object, :data:`IN_FORCE`, holds
them with what DeepSpeed's module held when ds_pipe_ckpt last wrote or read
it, and its methods are the only way to read or replace either. No other
module holds configuration.

DeepSpeed's checkpointing module is kept equal to the settings in force (the
reentrant mode delegates to it); a change made to it behind
ds_pipe_ckpt's wrappers (:mod:`ds_pipe_ckpt.deepspeed_wrappers`) is
adopted as a program call on the next use.

What it is for: which source's settings are in force, and keeping DeepSpeed's
checkpointing module equal to them. What it must not do: hold a rule on a
key's value (those are :mod:`ds_pipe_ckpt.config`'s; what is checked here is
the process, DeepSpeed's options that need torch.distributed) or read a
config document itself (:mod:`ds_pipe_ckpt.ds_config` does).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from deepspeed import comm as ds_comm

from .config import CheckpointingConfig
from .ds_config import load_ds_config
from .options import CheckpointOptions
from .errors import ConfigError
from .parallel import TensorParallelGroup
from .regions import RegionRegistry
from . import upstream_checkpointing as upstream

logger = logging.getLogger("ds_pipe_ckpt")

__all__ = ["CheckpointingSettings", "ConfigSources", "SettingsInForce", "IN_FORCE", "configure", "current_settings",
           "configure_job", "note_job_use_reentrant", "record_deepspeed_configure", "restore_defaults",
           "route_deepspeed_checkpoint"]

# Options the reentrant mode delegates to DeepSpeed's checkpointing module (the
# non-reentrant mode implements them in ds_pipe_ckpt.placement).
_UPSTREAM_OPTIONS = (
    "partition_activations",
    "cpu_checkpointing",
    "contiguous_memory_optimization",
    "synchronize_checkpoint_boundary",
    "profile",
)


@dataclass(frozen=True)
class ConfigSources:
    """What the settings in force were built from (see the module docstring):
    :class:`~ds_pipe_ckpt.CheckpointingConfig` fields by source, and the ``mpu``."""

    job: Mapping[str, Any] = field(default_factory=dict)
    job_mpu: Any = None
    program: Mapping[str, Any] = field(default_factory=dict)
    program_mpu: Any = None
    program_call: str = ""  # e.g. "deepspeed.checkpointing.configure()", for messages

    def in_rising_precedence(self) -> tuple[tuple[Mapping[str, Any], Any], tuple[Mapping[str, Any], Any]]:
        """The sources over the defaults, lowest first, as (fields, ``mpu``):
        the job's, then the program's. The one place the order is written."""
        return (self.job, self.job_mpu), (self.program, self.program_mpu)

    def config(self) -> CheckpointingConfig:
        """The defaults, then each source's fields over them (validated)."""
        fields: dict[str, Any] = {}
        for values, _ in self.in_rising_precedence():
            fields.update(values)
        return CheckpointingConfig(**fields)

    @property
    def mpu(self) -> Any:
        """The ``mpu`` of the highest source that gives one (None: none does)."""
        units = [unit for _, unit in self.in_rising_precedence() if unit is not None]
        return units[-1] if units else None

    def conflicts(self) -> list[str]:
        """Where the program's call overrides a value the JSON gives, in words."""
        (job, job_mpu), (program, program_mpu) = self.in_rising_precedence()
        notes = [f"{_json_key(name)} = {job[name]!r} in the JSON, {program[name]!r} by "
                 f"{self.program_call}: {program[name]!r} is in force"
                 for name in sorted(job.keys() & program.keys()) if job[name] != program[name]]
        if job_mpu is not None and program_mpu is not None and job_mpu is not program_mpu:
            notes.append(f"the model-parallel unit given by {self.program_call} is in force over the "
                         "pipeline's grid (initialize)")
        return notes


def _json_key(name: str) -> str:
    return f"pipeline.{name}" if name == "use_reentrant" else f"activation_checkpointing.{name}"


@dataclass
class CheckpointingSettings:
    """Configuration plus the model-parallel unit (``mpu``) it applies to."""

    config: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    model_parallel: TensorParallelGroup | None = None
    # Where config came from (see the module docstring).
    sources: ConfigSources = field(default_factory=ConfigSources, repr=False, compare=False)
    # ds_pipe_ckpt.route_deepspeed_checkpoint(): deepspeed.checkpointing.checkpoint calls run ds_pipe_ckpt's.
    routes_deepspeed_checkpoint: bool = False
    # Warnings already issued, so that each is logged once per configuration.
    warned: set = field(default_factory=set)
    # What the functions given to checkpoint() showed on their first call
    # (carried over by configure(): it does not depend on the configuration).
    regions: RegionRegistry = field(default_factory=RegionRegistry, repr=False, compare=False)
    # Resolved per-call options, by the keywords they were resolved from.
    _options: dict = field(default_factory=dict, repr=False, compare=False)
    # State the checkpoints of this configuration share (buffer pool, profile
    # records): a ds_pipe_ckpt.placement.runtime.CheckpointRuntime, created on first use.
    runtime: Any = field(default=None, repr=False, compare=False)

    def options(self, **keywords: Any) -> CheckpointOptions:
        """:meth:`CheckpointOptions.resolve` of ``keywords`` (``None``: as
        configured) under this configuration, cached: it runs on every
        checkpointed call."""
        # Names, values and their types: True and 1 are equal keys, and only one of them is valid.
        values = tuple(keywords.values())
        key = (tuple(keywords), values, tuple(map(type, values)))
        try:
            return self._options[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable value: resolve() names it
            return CheckpointOptions.resolve(self.config, **keywords)
        options = self._options[key] = CheckpointOptions.resolve(self.config, **keywords)
        if len(self._options) > 64:  # e.g. a new context_fn per call
            self._options.pop(next(iter(self._options)))
        return options

    def warn_once(self, key: str, message: str, category: type[Warning] = UserWarning) -> None:
        """Issue ``message`` the first time ``key`` is seen under this configuration."""
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, category, stacklevel=3)

    def log_once(self, key: str, message: str) -> None:
        """Log ``message`` (a warning) the first time ``key`` is seen under this configuration."""
        if key not in self.warned:
            self.warned.add(key)
            logger.warning("ds_pipe_ckpt: %s", message)


class SettingsInForce:
    """The process's settings in force, and what DeepSpeed's checkpointing
    module held when ds_pipe_ckpt last wrote or read it. One instance,
    :data:`IN_FORCE`; its methods are the only readers and writers of both."""

    def __init__(self) -> None:
        self._settings = CheckpointingSettings()
        self._upstream_seen = upstream.state_key()

    @property
    def settings(self) -> CheckpointingSettings:
        """The settings in force as last replaced (no look at DeepSpeed's module)."""
        return self._settings

    def replace(self, settings: CheckpointingSettings) -> None:
        """Put ``settings`` in force; DeepSpeed's module, as it is now, is what they mirror."""
        self._settings = settings
        self._upstream_seen = upstream.state_key()

    def upstream_changed(self) -> bool:
        """Whether DeepSpeed's module changed since ds_pipe_ckpt last wrote or read it."""
        return upstream.state_key() != self._upstream_seen

    def mark_upstream_seen(self, state: tuple) -> None:
        """Take DeepSpeed's module state ``state`` as seen (adopted once, whatever follows)."""
        self._upstream_seen = state


IN_FORCE = SettingsInForce()


def current_settings() -> CheckpointingSettings:
    """The settings in force (defaults until something configures them).

    DeepSpeed's checkpointing module is checked first: a configuration made on
    it without going through ds_pipe_ckpt's wrapper of
    ``deepspeed.checkpointing.configure`` is adopted as the program's latest
    call (a one-time log line names the values)."""
    if IN_FORCE.upstream_changed():
        _adopt_upstream()
    return IN_FORCE.settings


def _model_parallel_group(config: CheckpointingConfig, mpu: Any) -> TensorParallelGroup | None:
    """The group partitioned activations are split over. Without an ``mpu``,
    partitioning has a group of one rank (nothing to split), as upstream
    DeepSpeed trains then too."""
    if mpu is not None:
        return TensorParallelGroup.from_mpu(mpu)
    if config.partition_activations:
        logger.info("activation_checkpointing.partition_activations is true but no model-parallel unit (mpu) "
                    "was given: partitioning over a group of one rank, i.e. the inputs are kept whole. Pass "
                    "mpu= to configure() (ds_pipe_ckpt.initialize passes a PipelineModule's grid).")
        return TensorParallelGroup.single()
    return None


def _configure_upstream(config: CheckpointingConfig, model_parallel: TensorParallelGroup | None) -> None:
    """Mirror the options into DeepSpeed's checkpointing module, which the
    reentrant mode delegates to. DeepSpeed's configure() needs torch.distributed;
    the non-reentrant mode does not use DeepSpeed's copy of these options."""
    if not ds_comm.is_initialized():
        needs_dist = [k for k in _UPSTREAM_OPTIONS if getattr(config, k)
                      and not (k == "partition_activations" and model_parallel.world_size == 1)]
        if needs_dist and config.use_reentrant:
            raise ConfigError(f"activation_checkpointing.{needs_dist[0]}", True,
                              "false before torch.distributed is initialized in the reentrant mode",
                              "Call deepspeed.init_distributed() first (the reentrant mode delegates this "
                              "option to DeepSpeed), or set pipeline.use_reentrant to false.")
        return
    # Over a group of one there is nothing to partition; DeepSpeed would still
    # copy every input (and gather over its default group).
    partition = config.partition_activations and model_parallel.world_size > 1
    upstream.ORIGINAL_CONFIGURE(
        model_parallel,
        partition_activations=partition,
        contiguous_checkpointing=config.contiguous_memory_optimization and partition,
        num_checkpoints=config.number_checkpoints,
        checkpoint_in_cpu=config.cpu_checkpointing,
        synchronize=config.synchronize_checkpoint_boundary,
        profile=config.profile,
    )


def _apply(sources: ConfigSources, *, routes: bool | None = None) -> CheckpointingSettings:
    """Build, check and swap in the settings of ``sources``; DeepSpeed's module
    mirrors them. On an error nothing changes."""
    config = sources.config()
    model_parallel = _model_parallel_group(config, sources.mpu)
    _configure_upstream(config, model_parallel)
    previous = IN_FORCE.settings
    # What regions showed on their first call does not depend on the
    # configuration: keep it, so that reconfiguring does not relearn every region.
    settings = CheckpointingSettings(config=config, model_parallel=model_parallel, sources=sources,
                                     routes_deepspeed_checkpoint=previous.routes_deepspeed_checkpoint
                                     if routes is None else routes, regions=previous.regions)
    # A note already logged under the previous settings is not logged again.
    settings.warned.update(key for key in previous.warned if key.startswith("conflict:"))
    IN_FORCE.replace(settings)
    for note in sources.conflicts():
        settings.log_once(f"conflict:{note}", note)
    logger.info("activation checkpointing configured: %s", config)
    return settings


def configure(mpu_: Any = None,
              deepspeed_config: Any = None,
              partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None,
              num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None,
              synchronize: bool | None = None,
              profile: bool | None = None,
              *,
              mpu: Any = None,
              **overrides: Any) -> CheckpointingSettings:
    """Configure activation checkpointing in code: drop-in for
    ``deepspeed.checkpointing.configure`` (the same arguments, names and
    positional order), and the same source as a call to that: the program's.

    The call replaces the program's previous call: the keys its
    ``deepspeed_config`` names, then its keyword values that are not ``None``,
    over the job's JSON config (what ``ds_pipe_ckpt.initialize`` read, which
    it never undoes), over the defaults. The result is the process-wide
    settings object (returned; DeepSpeed's checkpointing configuration is
    process-wide too), and DeepSpeed's checkpointing module is set to match it.

    Args:
        mpu_: model-parallel unit (``get_model_parallel_group/rank/world_size``,
            or the tensor-parallel variants; a pipeline's ``PipelineModule.mpu()``
            grid works): the group ``partition_activations`` splits over;
            ``None``: the pipeline's grid where ``ds_pipe_ckpt.initialize`` gave
            one, else a group of one rank (a one-time log note). (A call of
            ``deepspeed.checkpointing.configure`` with ``None`` keeps the unit of
            its earlier call, as DeepSpeed does.) ``mpu=`` is accepted as well.
        deepspeed_config: a DeepSpeed config dict, JSON path or base64 string; its
            ``pipeline.use_reentrant`` and ``activation_checkpointing`` keys are read.
        partition_activations, contiguous_checkpointing, num_checkpoints,
        checkpoint_in_cpu, synchronize, profile: DeepSpeed's overrides of the
            ``activation_checkpointing`` keys; ``None`` leaves a value to the
            call's ``deepspeed_config``, the job's JSON or the default.
        **overrides: ours: ``use_reentrant``, ``debug``, ``verify_recompute``,
            ``early_stop``, ``policy``, ``save_ops`` (``None``: as above).

    Raises:
        ConfigError: a value of the wrong type or range, an unknown
            ``activation_checkpointing`` key, an ``mpu`` without model-parallel
            methods; the settings in force are then unchanged.
        TypeError: an unknown keyword, or ``mpu_`` and ``mpu`` both given.
    """
    if mpu_ is not None and mpu is not None and mpu_ is not mpu:
        raise TypeError("configure() got two model-parallel units: pass either mpu_ (DeepSpeed's name) or mpu")
    keywords = dict(partition_activations=partition_activations, contiguous_checkpointing=contiguous_checkpointing,
                    num_checkpoints=num_checkpoints, checkpoint_in_cpu=checkpoint_in_cpu, synchronize=synchronize,
                    profile=profile, **overrides)
    current_settings()  # a change made to DeepSpeed's module before this call is adopted first
    return _configure_program("ds_pipe_ckpt.configure()", mpu_ if mpu_ is not None else mpu, deepspeed_config,
                              keywords)


def _configure_program(call: str, mpu: Any, deepspeed_config: Any, keywords: dict) -> CheckpointingSettings:
    # IN_FORCE's sources, not current_settings()'s: DeepSpeed's module has just been
    # changed by the call being recorded, which is no change behind our back.
    program = {**CheckpointingConfig.named_in(load_ds_config(deepspeed_config)),
               **CheckpointingConfig.override_fields(**keywords)}
    return _apply(replace(IN_FORCE.settings.sources, program=program, program_call=call, program_mpu=mpu))


def record_deepspeed_configure(mpu_: Any, deepspeed_config: Any, **keywords: Any) -> CheckpointingSettings:
    """A call of ``deepspeed.checkpointing.configure`` (DeepSpeed's function has
    run): the program's latest configure call, as for :func:`configure`, except
    that ``mpu_=None`` keeps the unit of an earlier call, as DeepSpeed keeps it."""
    if mpu_ is None:
        mpu_ = IN_FORCE.settings.sources.program_mpu
    return _configure_program(upstream.CONFIGURE_CALL, mpu_, deepspeed_config, keywords)


def configure_job(param_dict: Any, mpu: Any = None) -> CheckpointingSettings:
    """The job's JSON config (``ds_pipe_ckpt.initialize``): its keys replace the
    job's source; what the program configured in code stays in force over them."""
    sources = current_settings().sources
    return _apply(replace(sources, job=CheckpointingConfig.named_in(load_ds_config(param_dict)), job_mpu=mpu))


def note_job_use_reentrant(use_reentrant: bool) -> None:
    """The job's ``pipeline.use_reentrant`` as DeepSpeed's engine gave it to a
    pipeline (``deepspeed.initialize`` without ``ds_pipe_ckpt.initialize``), so
    that :func:`ds_pipe_ckpt.checkpoint` follows it too."""
    sources = current_settings().sources
    if sources.job.get("use_reentrant") != use_reentrant:
        _apply(replace(sources, job={**sources.job, "use_reentrant": use_reentrant}))


def route_deepspeed_checkpoint(enabled: bool = True) -> None:
    """Run every ``deepspeed.checkpointing.checkpoint(function, *args)`` call of
    this process as :func:`ds_pipe_ckpt.checkpoint`, under the settings in force
    (``pipeline.use_reentrant`` included), for training stacks whose own layers
    call DeepSpeed's checkpoint (Megatron-DeepSpeed's ``tensor_parallel.checkpoint``,
    GPT-NeoX's ``checkpoint``). The keyword arguments of those calls go to
    ``function``, as DeepSpeed passes them. ``False`` gives the calls back to
    DeepSpeed's reentrant checkpoint. Explicit on purpose: nothing routes them
    otherwise, and a job whose ``use_reentrant`` is false while they still run
    upstream's checkpoint logs so once."""
    if not isinstance(enabled, bool):
        raise ConfigError("route_deepspeed_checkpoint(enabled)", enabled, "True or False")
    current_settings().routes_deepspeed_checkpoint = enabled


def restore_defaults() -> CheckpointingSettings:
    """Forget every source (the job's, the program's, the routing): the
    defaults are in force again, DeepSpeed's module included (for tests and
    notebooks that build several jobs in one process)."""
    return _apply(ConfigSources(), routes=False)


def _adopt_upstream() -> None:
    state = upstream.snapshot()
    sources = IN_FORCE.settings.sources
    mpu = state.mpu
    if mpu is None or isinstance(mpu, TensorParallelGroup) or mpu is sources.job_mpu:
        mpu = sources.program_mpu  # what _configure_upstream wrote, or the job's
    IN_FORCE.mark_upstream_seen(tuple(state))  # whatever happens next, adopt this state once
    settings = _apply(replace(sources, program=state.fields(), program_mpu=mpu,
                              program_call="a direct change of DeepSpeed's checkpointing module"))
    settings.log_once("adopted-upstream", "DeepSpeed's checkpointing module was changed behind ds_pipe_ckpt's "
                      f"wrapper of {upstream.CONFIGURE_CALL} (a function imported before ds_pipe_ckpt, or its "
                      "globals set): "
                      f"its values are the program's now: {state.fields()}")
