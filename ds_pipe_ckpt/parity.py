"""Gradient parity: a pipeline's training step against the same layers without a pipeline.

What "the right gradients" means for a pipeline is what the same layers get
when trained as one plain module on the mean loss over the step's
micro-batches (every pipeline step accumulates gradients over its
micro-batches, and data parallelism averages over the replicas' too).
:func:`check_gradient_parity` runs both, one step or a few, and compares each
stage's parameter updates under SGD with learning rate 1 (so an update is the
gradient, clipped where ``gradient_clipping`` is set) and the losses::

    # on every rank of the job (deepspeed launcher, torchrun, ds_pipe_ckpt.testing.run_ranks)
    report = check_gradient_parity(layers, loss_fn, micro_batches, config, num_stages=2)
    report.raise_if_different()   # or read report.stages / print(report)

The update, not ``param.grad``, is compared because it is what every precision
path of the engine produces the same way (with ZeRO or bf16 the gradients live
in the optimizer's own buffers); it is read from the optimizer's float32 master
weights where it keeps them (``deepspeed.utils.safe_get_full_fp32_param``). The reference runs in float32 on this rank,
on every micro-batch of the step (all data-parallel replicas'), in the order
the pipeline takes them, each loss divided by the number of micro-batches.

It must not change the model it is given: both modules are built here from
the layer specs, the plain one first, and the pipeline's layers get its weights.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec as _DSLayerSpec
from deepspeed.pipe import TiedLayerSpec as _DSTiedLayerSpec
from deepspeed.utils import safe_get_full_fp32_param

from .errors import ConfigError

__all__ = ["FP32_TOLERANCE", "BF16_TOLERANCE", "StageParity", "ParityReport", "PlainPipeline",
           "check_gradient_parity"]

# Largest relative difference (||update - reference|| / ||reference||, the
# 2-norms over all of a stage's parameters) allowed in float32. The pipeline and the reference do the same
# operations on the same values, but not always in the same order: the
# data-parallel all-reduce sums replicas' gradients in its own order, the
# clipping norm sums per-stage parts, and DeepSpeed divides by the
# accumulation steps where the reference divides each loss. Each reordering
# costs a few float32 rounding errors (2**-24 = 6e-8 relative each) on sums
# of up to tens of terms: measured differences are 0 to 4e-7. 1e-5 leaves a
# factor of 25 above that and is 10**4 below the smallest scale error this
# check exists to catch (a factor of 1/2 or 2).
FP32_TOLERANCE = 1e-5
# bf16 keeps 8 bits of mantissa (2**-8 = 0.4% relative per rounding) and the
# forward and backward are rounded (and, where DeepSpeed keeps no float32
# master weights, the update too); measured differences are 0.3-2%. 5% is still
# 15 times below a scale error of 1/GA with GA 2.
BF16_TOLERANCE = 5e-2


@dataclass(frozen=True)
class StageParity:
    """One pipeline stage's update against the reference's for the same parameters."""

    stage: int
    relative_difference: float  # ||update - reference|| / ||reference||, over all the stage's parameters
    update_ratio: float          # ||update|| / ||reference||: 1 when right, 1/GA or GA for a scale error
    worst_parameter: str         # the stage's parameter with the largest difference
    parameters: int              # how many parameters (tensors) were compared


@dataclass(frozen=True)
class ParityReport:
    """Every stage's :class:`StageParity` (the largest over its data-parallel
    replicas) and the losses, the same on every rank."""

    stages: tuple[StageParity, ...]
    losses: tuple[float, ...]            # what engine.train_batch() returned, per step
    reference_losses: tuple[float, ...]  # the plain module's mean loss, per step
    tolerance: float

    @property
    def loss_difference(self) -> float:
        return max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(self.losses, self.reference_losses)),
                   default=0.0)

    @property
    def ok(self) -> bool:
        return self.loss_difference <= self.tolerance and all(
            s.relative_difference <= self.tolerance for s in self.stages)

    def raise_if_different(self) -> None:
        """Raise ``AssertionError`` with this report when a stage or a loss is
        outside the tolerance."""
        if not self.ok:
            raise AssertionError(f"the pipeline's step differs from the same layers without a pipeline:\n{self}")

    def __str__(self) -> str:
        lines = [f"{'stage':>5}  {'relative difference':>19}  {'update ratio':>12}  worst parameter",
                 *(f"{s.stage:>5}  {s.relative_difference:>19.3g}  {s.update_ratio:>12.4f}  {s.worst_parameter}"
                   for s in self.stages),
                 f"losses {list(self.losses)} against {list(self.reference_losses)} "
                 f"(relative difference {self.loss_difference:.3g}); tolerance {self.tolerance:g}"]
        return "\n".join(lines)


class PlainPipeline(torch.nn.Module):
    """The layers of a pipeline as one module: what they compute without a
    pipeline. Specs are built in order (a ``TiedLayerSpec`` key once, used at
    each of its positions through its ``forward_fn``); modules and callables
    are used as given; each layer is called on the previous one's output, as
    DeepSpeed's ``PipelineModule`` calls them."""

    def __init__(self, layers: Sequence[Any]):
        super().__init__()
        self.layers = torch.nn.ModuleDict()
        self.tied = torch.nn.ModuleDict()
        self._calls: list[Callable[[Any], Any]] = []
        for index, layer in enumerate(layers):
            if isinstance(layer, _DSTiedLayerSpec):
                if layer.key not in self.tied:
                    self.tied[layer.key] = layer.build()
                module = self.tied[layer.key]
                forward_fn = layer.forward_fn
                self._calls.append(module if forward_fn is None else
                                   (lambda x, m=module, f=forward_fn: f(m, x)))
            elif isinstance(layer, _DSLayerSpec):
                self.layers[str(index)] = layer.build()
                self._calls.append(self.layers[str(index)])
            elif isinstance(layer, torch.nn.Module):
                self.layers[str(index)] = copy.deepcopy(layer)
                self._calls.append(self.layers[str(index)])
            elif callable(layer):
                self._calls.append(layer)
            else:
                raise ConfigError(f"layers[{index}]", layer, "a LayerSpec, TiedLayerSpec, nn.Module or callable")

    def forward(self, x: Any) -> Any:
        for call in self._calls:
            x = call(x)
        return x

    def counterpart(self, pipeline: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        """This module's parameter for each of ``pipeline``'s (a stage of a
        ``PipelineModule`` built from the same layers), by the pipeline's names."""
        mine = {}
        for name, _ in pipeline.named_parameters():
            head, _, rest = name.partition(".")
            if head == "tied_modules":
                key, _, rest = rest.partition(".")
                mine[name] = self.tied[key].get_parameter(rest)
            else:
                mine[name] = self.layers[head].get_parameter(rest)
        return mine


def _reference_steps(plain: PlainPipeline, loss_fn: Callable[..., Any], steps: list[list[tuple[Any, Any]]],
                     clip: float) -> list[float]:
    """SGD with learning rate 1 on ``plain``: each step's loss is the mean of
    ``loss_fn`` over its micro-batches; returns those means."""
    parameters = [p for p in plain.parameters() if p.requires_grad]
    losses = []
    for micro_batches in steps:
        for p in parameters:
            p.grad = None
        total = 0.0
        for inputs, labels in micro_batches:
            loss = loss_fn(plain(inputs), labels)
            (loss / len(micro_batches)).backward()
            total += float(loss.detach())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(parameters, clip)
        with torch.no_grad():
            for p in parameters:
                if p.grad is not None:
                    p.sub_(p.grad)
        losses.append(total / len(micro_batches))
    return losses


def _stage_parity(stage: int, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
                  reference_before: dict[str, torch.Tensor], reference_after: dict[str, torch.Tensor]) -> StageParity:
    difference_sq, reference_sq, update_sq, worst, worst_name = 0.0, 0.0, 0.0, -1.0, ""
    for name in before:
        update = after[name] - before[name]
        reference = reference_after[name] - reference_before[name]
        difference = float((update - reference).double().square().sum())
        if difference > worst:
            worst, worst_name = difference, name
        difference_sq += difference
        update_sq += float(update.double().square().sum())
        reference_sq += float(reference.double().square().sum())
    if reference_sq > 0:
        relative, ratio = math.sqrt(difference_sq / reference_sq), math.sqrt(update_sq / reference_sq)
    else:
        relative, ratio = (0.0, 1.0) if update_sq == 0 else (math.inf, math.inf)
    return StageParity(stage, relative, ratio, worst_name, len(before))


def _master_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's value as the optimizer updates it: the float32 master
    copy where ZeRO or the bf16 optimizer keeps one (a bf16 parameter would
    round a small update away), else the parameter. A collective under ZeRO:
    every rank of the stage calls it."""
    weights = {}
    for name, parameter in module.named_parameters():
        master = safe_get_full_fp32_param(parameter)
        weights[name] = (parameter if master is None else master).detach().float().clone()
    return weights


def _to_dtype(value: Any, dtype: torch.dtype) -> Any:
    """``value``'s floating-point tensors (in tuples too) as ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_to_dtype(v, dtype) for v in value)
    return value


def _config_for_parity(config: dict) -> dict:
    for key in ("optimizer", "scheduler"):
        if key in config:
            raise ConfigError(key, config[key], "absent",
                              "check_gradient_parity compares updates under its own SGD with learning rate 1 "
                              "(the update is then the gradient); drop the section for the check.")
    config = copy.deepcopy(config)
    if config.get("zero_optimization"):
        # DeepSpeed asks this of any client optimizer under ZeRO; the check's own is SGD.
        config.setdefault("zero_allow_untested_optimizer", True)
    return config


def check_gradient_parity(layers: Sequence[Any], loss_fn: Callable[..., Any],
                          micro_batches: Sequence[tuple[Any, Any]], config: dict, *, num_stages: int,
                          steps: int = 1, partition_method: str = "uniform", seed: int = 0,
                          tolerance: float | None = None, initialize: Callable[..., Any] | None = None,
                          **module_kwargs: Any) -> ParityReport:
    """Train ``layers`` for ``steps`` steps as a ``ds_pipe_ckpt.PipelineModule``
    of ``num_stages`` stages under ``initialize`` (``ds_pipe_ckpt.initialize`` by
    default; ``deepspeed.initialize`` to check upstream's engine) and as a
    :class:`PlainPipeline`, both with SGD at learning rate 1 from the same
    weights; return how far each stage's update is from the plain module's.

    Call it on every rank of the job, with the same arguments. ``micro_batches``
    holds ``(inputs, labels)`` for every micro-batch of every step and every
    data-parallel replica: step ``s``, replica ``d``, micro-batch ``k`` is item
    ``(s * dp + d) * gradient_accumulation_steps + k``. ``config`` is the DeepSpeed
    JSON config as a dict, without ``optimizer`` or ``scheduler``; the reference
    clips by ``torch.nn.utils.clip_grad_norm_`` to the engine's ``gradient_clipping``
    (DeepSpeed's default is 1.0).
    ``module_kwargs`` go to ``PipelineModule`` (``activation_checkpoint_interval``,
    ``checkpointable_layers``, ``topology``, ...). ``tolerance`` defaults to
    :data:`FP32_TOLERANCE`, or :data:`BF16_TOLERANCE` with ``bf16.enabled``.

    Raises:
        ConfigError: ``optimizer``/``scheduler`` in ``config``, too few
            micro-batches, or a topology with tensor parallelism (its layers
            have no plain counterpart to build here).
    """
    from .initialize import initialize as ds_pipe_ckpt_initialize
    from .pipe import PipelineModule

    config = _config_for_parity(config)
    bf16 = bool((config.get("bf16") or {}).get("enabled"))
    tolerance = tolerance if tolerance is not None else (BF16_TOLERANCE if bf16 else FP32_TOLERANCE)
    torch.manual_seed(seed)
    plain = PlainPipeline(layers)
    module = PipelineModule(layers=layers, num_stages=num_stages, loss_fn=loss_fn,
                            partition_method=partition_method, **module_kwargs)
    if module._topo.get_dim("model") > 1:
        raise ConfigError("topology", module._topo, "a topology without a model (tensor-parallel) axis",
                          "Tensor-parallel layers have no plain counterpart for check_gradient_parity to build.")
    counterpart = plain.counterpart(module)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            parameter.copy_(counterpart[name])
    dp = module._topo.get_dim("data")
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1.0)
    engine, *_ = (initialize or ds_pipe_ckpt_initialize)(model=module, optimizer=optimizer, config=config)
    accumulation = engine.gradient_accumulation_steps()
    clip = float(engine.gradient_clipping() or 0.0)  # DeepSpeed's default is 1.0, not off
    per_step = dp * accumulation
    if len(micro_batches) < steps * per_step:
        raise ConfigError("micro_batches", f"{len(micro_batches)} micro-batches",
                          f"at least steps x data-parallel size x gradient_accumulation_steps = "
                          f"{steps} x {dp} x {accumulation}")
    if bf16:  # the engine runs the layers in bf16 and leaves the inputs to the caller
        micro_batches = [(_to_dtype(x, torch.bfloat16), y) for x, y in micro_batches]
    replica = engine.grid.get_data_parallel_rank()
    mine = [micro_batches[(s * dp + replica) * accumulation + k] for s in range(steps) for k in range(accumulation)]
    before = _master_weights(module)
    data = iter(mine)
    losses = tuple(float(engine.train_batch(data_iter=data)) for _ in range(steps))
    after = _master_weights(module)

    reference_before = {name: p.detach().clone() for name, p in counterpart.items()}
    if bf16:  # the reference in float32 from the same (rounded) inputs
        micro_batches = [(_to_dtype(x, torch.float32), y) for x, y in micro_batches]
    reference_losses = _reference_steps(plain, loss_fn,
                                        [list(micro_batches[s * per_step:(s + 1) * per_step]) for s in range(steps)],
                                        clip)
    reference_after = {name: p.detach().clone() for name, p in counterpart.items()}
    mine_parity = _stage_parity(engine.stage_id, before, after, reference_before, reference_after)

    gathered = [mine_parity]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine_parity)
    stages = tuple(max((p for p in gathered if p.stage == stage), key=lambda p: p.relative_difference)
                   for stage in sorted({p.stage for p in gathered}))
    return ParityReport(stages, losses, tuple(reference_losses), tolerance)
