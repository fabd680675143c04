"""``PipelineModule``: DeepSpeed's pipeline module with per-segment activation
checkpointing on torch's non-reentrant checkpoint."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import deepspeed
import torch
from deepspeed.pipe import LayerSpec as _DSLayerSpec
from deepspeed.pipe import PipelineModule as _DSPipelineModule
from deepspeed.pipe import TiedLayerSpec as _DSTiedLayerSpec
from deepspeed.runtime import utils as ds_utils
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

from . import gradient_accumulation
from .checkpoint import checkpoint_region
from .config import LENGTH_BUCKETS, validate_interval
from .errors import ConfigError
from .module_arguments import check_module_arguments, require_checkpoint_func
from .regions import Region, RegionFacts, describe_callable, modules_of
from .segment_choice import frees_nothing, segment_choices
from .stage_planning import enable_planning
from .settings import current_settings, note_job_use_reentrant
from .upstream_checkpointing import ORIGINAL_CHECKPOINT, is_deepspeed_checkpoint

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "REENTRANT", "NON_REENTRANT", "CUSTOM"]

REENTRANT = "reentrant"
NON_REENTRANT = "non_reentrant"
CUSTOM = "custom"

# Set by ds_pipe_ckpt.initialize on the module whose engine it corrects (gradient
# accumulation scale, clipping norm); a module trained without it warns once.
ENGINE_CORRECTED = "_engine_corrected_by_ds_pipe_ckpt"


class LayerSpec(_DSLayerSpec):
    """Deferred construction of one pipeline layer: ``LayerSpec(typename, *args, **kwargs)``
    builds ``typename(*args, **kwargs)`` only on the stage that owns the layer.

    Same class contract as ``deepspeed.pipe.LayerSpec`` (it is a subclass).
    """


class TiedLayerSpec(_DSTiedLayerSpec, LayerSpec):
    """A layer whose module (and weights named by ``tied_weight_attr``) is shared
    by every position that uses the same ``key``, e.g. tied input/output
    embeddings; gradients of the tied weights are all-reduced across the
    stages that hold a copy. ``forward_fn(module, x)``, when given, replaces
    ``module(x)`` at that position.

    Same class contract as ``deepspeed.pipe.TiedLayerSpec`` (it is a subclass).
    """


def _layer_name(layer: Any) -> str:
    """A layer's class; for a TiedLayerSpec's ``forward_fn`` (a partial over the
    tied module), the function's name."""
    if isinstance(layer, _DSLayerSpec):
        return layer.typename.__name__
    return describe_callable(layer)


def _require_one_mode(settings: Any, mode: str, name: str) -> None:
    """One ``use_reentrant`` for the job: a configure call in code that chose
    the other mode than the pipeline's (DeepSpeed's engine gives the pipeline
    the JSON's ``pipeline.use_reentrant``) is refused, not half obeyed."""
    chosen = settings.sources.program.get("use_reentrant")
    if chosen is not None and chosen != (mode == REENTRANT):
        raise ConfigError("use_reentrant", chosen, f"{mode == REENTRANT} (the pipeline's mode, which DeepSpeed's "
                          "engine set from pipeline.use_reentrant), or not given",
                          f"use_reentrant={chosen} given to {settings.sources.program_call} and the pipeline's "
                          f"JSON disagree at {name}; one mode holds for the whole job: set pipeline.use_reentrant in the JSON "
                          "and drop the keyword.")


class PipelineModule(_DSPipelineModule):
    """Drop-in for ``deepspeed.pipe.PipelineModule`` (a subclass: ``deepspeed.initialize``
    builds DeepSpeed's ``PipelineEngine`` around it).

    Constructor arguments and their meaning are upstream's. What differs:

    * Mode: ``pipeline.use_reentrant`` in the DeepSpeed JSON config (``true`` when
      absent). With ``false``, DeepSpeed's engine hands the module
      ``deepspeed.checkpointing.non_reentrant_checkpoint``; this module recognises it
      and runs every checkpointed segment through
      ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` instead, with
      DeepSpeed's model-parallel RNG tracker replayed on recomputation. This holds
      whatever the interval is when the engine is built, including 0 with
      :meth:`set_checkpoint_interval` called later.
    * Segments: ``activation_checkpoint_interval`` layers each. In non-reentrant mode
      every segment is checkpointable, parameter-free ones included, unless
      ``checkpointable_layers`` (class names) restricts it. Reentrant mode keeps
      upstream's choice (segments that own parameters).
    * Only segments whose checkpointing frees memory are checkpointed: one whose
      first call through torch's checkpoint (every call in non-reentrant mode,
      the fallback below in reentrant mode) saved for backward nothing but its
      inputs and its parameters (an embedding, a tied LM head, a cast, a
      reshape) runs plainly from then on, unless ``checkpointable_layers`` is
      given (the user's choice stands) or inputs are partitioned or offloaded
      (then checkpointing frees them). The same tensors are kept either way; no
      recomputation is paid. :attr:`segment_checkpointing` shows the choice.
    * Reentrant mode never loses parameter gradients: a segment whose tensor inputs
      do not require grad runs through the non-reentrant checkpoint, with a one-time
      :class:`~ds_pipe_ckpt.ReentrantFallbackWarning`.
    * Any other callable passed as ``activation_checkpoint_func`` is called as
      ``func(run_segment, *inputs)``, as upstream does.
    * Invalid arguments raise :class:`~ds_pipe_ckpt.ConfigError` instead of asserting.
    * ``partition_method="planned"`` with ``partition_planning=``
      :class:`~ds_pipe_ckpt.PartitionPlanning`: the stage boundaries are chosen
      together with each stage's checkpointing plan, for the least modelled 1F1B
      step time within each stage's budget, from a profile of the layer list
      (:mod:`ds_pipe_ckpt.planning.planned_partition`); the cut is
      ``partition_plan`` (and where its profile came from, ``partition_profile_source``).
      ``PartitionPlanning.from_config(ds_config, sample, labels)``
      reads the budget, micro-batches and profile path from the DeepSpeed JSON config.
    """

    def __init__(self,
                 layers: Sequence[Any],
                 num_stages: int | None = None,
                 topology: Any = None,
                 loss_fn: Callable[..., Any] | None = None,
                 seed_layers: bool = False,
                 seed_fn: Callable[[int], None] | None = None,
                 base_seed: int = 1234,
                 partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable[..., Any] = ORIGINAL_CHECKPOINT,
                 checkpointable_layers: Sequence[str] | None = None,
                 dynamic_shape: bool = False,
                 partition_planning: Any = None):
        checkpointable_layers = check_module_arguments(activation_checkpoint_interval, partition_method,
                                                       partition_planning, activation_checkpoint_func,
                                                       checkpointable_layers)
        # Read by _partition_layers, which DeepSpeed's __init__ calls.
        self.__dict__["_partition_planning"] = partition_planning
        self.__dict__["partition_plan"] = None
        self.__dict__["partition_profile_source"] = None
        self.__dict__["partition_method"] = partition_method  # checked against the JSON config's
        super().__init__(layers,
                         num_stages=num_stages,
                         topology=topology,
                         loss_fn=loss_fn,
                         seed_layers=seed_layers,
                         seed_fn=seed_fn,
                         base_seed=base_seed,
                         partition_method=partition_method,
                         activation_checkpoint_interval=activation_checkpoint_interval,
                         activation_checkpoint_func=activation_checkpoint_func,
                         checkpointable_layers=checkpointable_layers,
                         dynamic_shape=dynamic_shape)

    def _partition_layers(self, method: str = "uniform") -> None:
        """DeepSpeed's partitioning, plus ``"planned"``: the stage boundaries
        chosen with each stage's checkpointing plan
        (:mod:`ds_pipe_ckpt.planning.planned_partition`), exposed as
        ``partition_plan`` and printed on the first rank."""
        if method.lower() != "planned":
            return super()._partition_layers(method)
        from .planning.layer_profiling import spec_name
        from .planning.planned_partition import partition_table, planned_partition

        names = [spec_name(spec) for spec in self._layer_specs]
        plan, _, note = planned_partition(self._layer_specs, names, self.num_stages, self._partition_planning,
                                          loss_fn=self.loss_fn, data_parallel_size=self._topo.get_dim("data"))
        self.__dict__["partition_plan"] = plan
        self.__dict__["partition_profile_source"] = note
        self.parts = list(plan.boundaries)
        if self.global_rank == 0:
            print(partition_table(plan, names, note), flush=True)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def _synchronize_tied_weights(self) -> None:
        """Upstream's broadcast of each tied weight from its first stage, without
        autograd: recorded by autograd, the in-place ``broadcast_`` (a c10d op
        with no autograd kernel) makes torch warn at every later backward. The
        weights and gradients are the same either way."""
        with torch.no_grad():
            super()._synchronize_tied_weights()

    # -- checkpoint function and mode -------------------------------------------------
    # DeepSpeed's engine assigns ``activation_checkpoint_func`` and compares it by
    # identity with its own functions (to decide whether to force input
    # requires_grad), so the attribute keeps whatever was assigned; the mode is
    # derived from it.

    @property
    def activation_checkpoint_func(self) -> Callable[..., Any]:
        return self.__dict__["_activation_checkpoint_func"]

    @activation_checkpoint_func.setter
    def activation_checkpoint_func(self, func: Callable[..., Any]) -> None:
        self.__dict__["_activation_checkpoint_func"] = require_checkpoint_func(func)
        # Which segments are checkpointed depends on the mode: recompute the cache.
        self.__dict__["is_checkpointable_results_interval"] = None
        if func is ds_checkpointing.non_reentrant_checkpoint:
            # DeepSpeed's engine read "pipeline": {"use_reentrant": false}: the
            # job's mode, for ds_pipe_ckpt.checkpoint as for these segments.
            note_job_use_reentrant(False)

    @property
    def checkpoint_mode(self) -> str:
        """``"reentrant"``, ``"non_reentrant"`` or ``"custom"`` (a user function)."""
        func = self.activation_checkpoint_func
        if func is ds_checkpointing.non_reentrant_checkpoint:
            return NON_REENTRANT
        if is_deepspeed_checkpoint(func):
            return REENTRANT
        return CUSTOM

    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint every ``interval`` layers from the next forward on (0 disables).

        Not upstream's: before 0.19 it set an attribute nothing reads
        (``checkpoint_interval``), so the interval did not change."""
        validate_interval("activation_checkpoint_interval", interval)
        self.activation_checkpoint_interval = interval
        self._precompute_checkpointable_values()

    def _precompute_checkpointable_values(self) -> None:
        """Which segments of the current interval are checkpointed
        (``is_checkpointable_results``), rebuilt when the interval or the mode
        changes. Not upstream's: before 0.19 it appended the new results to the
        old ones, so after a change of mode the forward read stale entries."""
        interval = self.activation_checkpoint_interval
        if interval > 0 and self.is_checkpointable_results_interval != interval:
            funcs = self.forward_funcs
            self.is_checkpointable_results = [self._is_checkpointable(funcs[start:start + interval])
                                              for start in range(0, len(funcs), interval)]
            self.interval_was_zero = False
            self.is_checkpointable_results_interval = interval

    def _is_checkpointable(self, funcs: Sequence[Any]) -> bool:
        if self.checkpoint_mode == NON_REENTRANT:
            if self.checkpointable_layers is not None:
                return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
            return True
        return super()._is_checkpointable(funcs)

    # -- forward ----------------------------------------------------------------------

    def segment_label(self, start: int, end: int) -> str:
        """Human-readable name of local layers ``[start, end)``, with global indices."""
        labels = self.__dict__.setdefault("_segment_labels", {})
        if (start, end) not in labels:
            labels[(start, end)] = self._make_segment_label(start, end)
        return labels[(start, end)]

    def _make_segment_label(self, start: int, end: int) -> str:
        first = start + self._local_start
        names = ", ".join(_layer_name(f) for f in self.forward_funcs[start:end])
        span = f"layer {first}" if end - start == 1 else f"layers {first}-{first + end - start - 1}"
        return f"pipeline {span} ({names})"

    def _layer_range(self, start: int, end: int, seed_offset: int) -> Callable[..., Any]:
        def run_layers(*inputs: Any) -> Any:
            x = inputs[0] if len(inputs) == 1 else inputs
            for local_idx in range(start, end):
                layer_idx = local_idx + self._local_start
                self.curr_layer = layer_idx
                if self.seed_layers:
                    # Upstream's per-layer, per-micro-batch seed.
                    seed = self.base_seed * seed_offset + layer_idx
                    (self.seed_fn or ds_utils.set_random_seed)(seed)
                x = self.forward_funcs[local_idx](x)
            return x

        return run_layers

    def _segment_modules(self, start: int, end: int) -> tuple[torch.nn.Module, ...]:
        """The modules local layers ``[start, end)`` are made of (where the
        region looks for buffers its forward changes, with the modules it calls)."""
        cache = self.__dict__.setdefault("_modules_by_segment", {})
        if (start, end) not in cache:
            cache[(start, end)] = tuple(m for f in self.forward_funcs[start:end] for m in modules_of(f))
        return cache[(start, end)]

    def _segment_facts(self, start: int, end: int) -> RegionFacts:
        """What segment ``[start, end)`` showed on its first call (see :class:`~ds_pipe_ckpt.regions.RegionFacts`)."""
        return self.__dict__.setdefault("_facts_by_segment", {}).setdefault((start, end), RegionFacts())

    def _checkpoint_segment(self, run: Callable[..., Any], inputs: tuple, start: int, end: int, *,
                            policy: str | None = None, options: Any = None, observer: Any = None) -> Any:
        mode = self.checkpoint_mode
        if mode == CUSTOM:
            return self.activation_checkpoint_func(run, *inputs)
        region = Region(self.segment_label(start, end), micro_batch=self.micro_offset,
                        facts=self._segment_facts(start, end), modules=self._segment_modules(start, end))
        if options is None:
            settings = current_settings()
            _require_one_mode(settings, mode, region.name)
            options = settings.options(use_reentrant=mode == REENTRANT, policy=policy)
        return checkpoint_region(run, inputs, {}, region, options, observer=observer)

    def run_segment(self, x: Any, start: int, end: int, seed_offset: int, *, checkpointed: bool,
                    policy: str | None = None, options: Any = None, observer: Any = None) -> Any:
        """Run local layers ``[start, end)`` on ``x``: as one checkpointed region
        when ``checkpointed`` (with ``policy`` ``"full"``/``"selective"``, or
        explicit ``options``; None: as configured), else plainly."""
        run = self._layer_range(start, end, seed_offset)
        inputs = x if isinstance(x, tuple) else (x, )
        if not checkpointed:
            return run(*inputs)
        return self._checkpoint_segment(run, inputs, start, end, policy=policy, options=options, observer=observer)

    # -- planning ---------------------------------------------------------------------

    def enable_planning(self, budget_bytes: int | None, micro_batches: int, known_buffers: tuple = (),
                        max_memory_bytes: int | str | None = None, max_sequence_length: int | None = None,
                        sequence_dim: int = 1, length_buckets: int = LENGTH_BUCKETS) -> None:
        """Choose per layer what to checkpoint under a per-stage memory budget
        (``activation_checkpointing.memory_budget_mb`` or ``max_memory_mb``;
        ``ds_pipe_ckpt.initialize`` calls this); the arguments are
        :func:`ds_pipe_ckpt.stage_planning.enable_planning`'s."""
        enable_planning(self, budget_bytes, micro_batches, known_buffers, max_memory_bytes=max_memory_bytes,
                        max_sequence_length=max_sequence_length, sequence_dim=sequence_dim,
                        length_buckets=length_buckets, use_reentrant=self.checkpoint_mode != NON_REENTRANT)

    @property
    def planning_enabled(self) -> bool:
        """Whether a memory budget's planner chooses what this stage checkpoints."""
        return self.__dict__.get("_planner") is not None

    @property
    def checkpoint_plan(self) -> Any:
        """This stage's checkpointing plan (a :class:`~ds_pipe_ckpt.planning.planned.PlannedStage`:
        decisions per layer, predicted and measured peak), or None before the
        planner has measured the stage (its first training step) or when no
        budget is configured."""
        planner = self.__dict__.get("_planner")
        return None if planner is None else planner.planned

    @property
    def loss_fn(self) -> Callable[..., Any] | None:
        """The loss, as given (DeepSpeed's engine calls ``module.loss_fn(outputs,
        labels)`` on the last stage). While the planner measures variable
        lengths, the call also shows it the measured micro-batch's labels."""
        fn = self.given_loss_fn
        planner = self.__dict__.get("_planner")
        return fn if planner is None or fn is None else planner.observed_loss(fn)

    @property
    def given_loss_fn(self) -> Callable[..., Any] | None:
        """The loss exactly as given (a module-valued loss is a submodule, as upstream registers it)."""
        return self._modules["loss_fn"] if "loss_fn" in self._modules else self.__dict__.get("_loss_fn")

    @loss_fn.setter
    def loss_fn(self, fn: Callable[..., Any] | None) -> None:
        # nn.Module registers a module-valued loss (its state) without calling this.
        self.__dict__["_loss_fn"] = fn

    def train(self, mode: bool = True) -> "PipelineModule":
        """``nn.Module.train``. DeepSpeed's ``train_batch()`` calls it first: with
        a memory budget, that is where this stage's training step begins, for the
        planner's check of its peak memory."""
        super().train(mode)
        if mode:
            self._warn_if_engine_uncorrected()
        planner = self.__dict__.get("_planner")
        if mode and planner is not None:
            planner.training_step_may_begin()
        return self

    def _warn_if_engine_uncorrected(self) -> None:
        """Once: on a DeepSpeed that scales gradient accumulation wrongly, an engine
        built by ``deepspeed.initialize`` (not ``ds_pipe_ckpt.initialize``, which
        corrects it) trains with gradients off by a power of the accumulation steps."""
        if self.__dict__.get(ENGINE_CORRECTED) or self.__dict__.get("_warned_uncorrected"):
            return
        self.__dict__["_warned_uncorrected"] = True
        if gradient_accumulation.engine_scales_accumulation_wrongly():
            warnings.warn(f"ds_pipe_ckpt: DeepSpeed {deepspeed.__version__}'s pipeline engine does not divide "
                          "the gradients by gradient_accumulation_steps once on the last stage "
                          f"({gradient_accumulation.GRADIENT_ACCUMULATION_FIX}), so with more than one micro-batch "
                          "per step they differ from the model's without a pipeline. Build the engine with ds_pipe_ckpt.initialize "
                          "(same arguments as deepspeed.initialize), which corrects it.", UserWarning, stacklevel=3)

    def forward(self, forward_input: Any) -> Any:
        self.micro_offset += 1
        # Upstream seeds layers with micro_offset + 1; keep it for identical streams.
        seed_offset = self.micro_offset + 1
        planner = self.__dict__.get("_planner")
        if planner is not None:
            return planner.forward(forward_input, seed_offset)
        num_layers = len(self.forward_funcs)
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return self._layer_range(0, num_layers, seed_offset)(forward_input)

        self._precompute_checkpointable_values()
        x = forward_input
        for segment, start in enumerate(range(0, num_layers, interval)):
            end = min(start + interval, num_layers)
            checkpointed = self.is_checkpointable_results[segment] and not self._frees_nothing(start, end)
            x = self.run_segment(x, start, end, seed_offset, checkpointed=checkpointed)
        return x

    # -- which segments checkpointing helps -------------------------------------------

    def _frees_nothing(self, start: int, end: int) -> bool:
        """See :func:`ds_pipe_ckpt.segment_choice.frees_nothing`."""
        return frees_nothing(self, start, end,
                             user_chose=self.checkpointable_layers is not None or self.checkpoint_mode == CUSTOM)

    @property
    def segment_checkpointing(self) -> dict[str, str]:
        """How each segment of the current interval runs, by its label
        (:meth:`segment_label`): ``"checkpointed"``, ``"plain"``, ``"plain:
        frees nothing"`` or ``"not called yet"`` (see
        :func:`ds_pipe_ckpt.segment_choice.segment_choices`). Empty for a custom
        ``activation_checkpoint_func`` or with a memory budget (then see
        :attr:`checkpoint_plan`)."""
        if self.checkpoint_mode == CUSTOM or self.planning_enabled:
            return {}
        return segment_choices(self)
