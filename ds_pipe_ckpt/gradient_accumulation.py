"""The correction of a DeepSpeed pipeline engine's gradient-accumulation scale.

A pipeline step's gradients are the mean over its micro-batches, so the last
stage divides its loss's gradient by ``gradient_accumulation_steps`` once and
the other stages pass on what they receive. DeepSpeed 0.16 and 0.17 never
divide (DeepSpeed issue 7773: the engine skips its loss scaling because it
reduces gradients itself); 0.18 hooks every module output with
``_backward_prologue_per_tensor``, so every stage divides again what it
receives (DeepSpeed issue 8152); 0.19 (PR 8154) divides on the last stage
only. :func:`pipeline_gradient_scale` measures what the engine at hand does,
on its own stage, by calling the method that scales;
:func:`correct_gradient_accumulation` makes it 0.19's.

What it is for: measuring, on an engine, the factor its stage multiplies
gradients by, and replacing the method that scales where it is wrong
(``ds_pipe_ckpt.initialize``), and telling from the installed engine class
whether a correction is needed (the warning of ``PipelineModule.train``).
What it must not do: compare versions (it measures what the engine does;
version switches are :mod:`ds_pipe_ckpt.compat`), or change anything of an
engine but the method that scales.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import deepspeed
import torch

from .errors import ConfigError

__all__ = ["GRADIENT_ACCUMULATION_FIX", "pipeline_gradient_scale", "correct_gradient_accumulation",
           "engine_scales_accumulation_wrongly"]

GRADIENT_ACCUMULATION_FIX = ("DeepSpeed issues 7773 (0.16 and 0.17 never divide by gradient_accumulation_steps) "
                             "and 8152 (0.18 divides again on every stage); fixed in DeepSpeed 0.19.0 (PR 8154)")


def engine_scales_accumulation_wrongly(engine_class: Any = None) -> bool:
    """Whether the installed ``PipelineEngine`` class, read without an engine,
    has one of the two scalings :func:`correct_gradient_accumulation` corrects:
    no per-output hook (0.16, 0.17), or the base engine's hook not overridden
    for the pipeline (0.18). For a warning where no engine is at hand; an
    engine's own behaviour is :func:`pipeline_gradient_scale`."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    engine_class = engine_class or PipelineEngine
    if not hasattr(engine_class, "_backward_prologue_per_tensor"):
        return True
    return not any("_backward_prologue_per_tensor" in vars(cls) for cls in engine_class.__mro__
                   if cls.__name__ == "PipelineEngine")


def _with_accumulation_steps(engine: Any, steps: int, measure: Callable[[], float]) -> float:
    """``measure()`` while the engine's config says ``steps`` micro-batches per step."""
    config = engine._config
    saved = config.gradient_accumulation_steps
    config.gradient_accumulation_steps = steps
    try:
        return measure()
    finally:
        config.gradient_accumulation_steps = saved


def _prologue_scale(engine: Any, probe: torch.Tensor) -> float:
    """What ``DeepSpeedEngine._backward_prologue`` (0.16, 0.17: the last stage's
    ``backward(loss)`` scales the loss there) does to a loss of 1, with the
    training-loss log it keeps left as it was."""
    losses = engine.losses
    monitor = getattr(engine, "monitor", None)
    monitoring = getattr(monitor, "enabled", False)
    if monitoring:
        monitor.enabled = False
    try:
        return float(engine._backward_prologue(probe, True))
    finally:
        engine.losses = losses
        if monitoring:
            monitor.enabled = True


def pipeline_gradient_scale(engine: Any, accumulation_steps: int | None = None) -> float:
    """The factor by which ``engine`` multiplies, on its own stage, the gradient
    of its loss (last stage) or of its outputs (other stages), measured by
    calling the method of the engine that applies it, at ``accumulation_steps``
    (the configured value by default). Right: ``1 / steps`` on the last stage
    and 1 elsewhere; the gradient a stage passes on is the product along the
    stages after it."""
    probe = torch.ones((), dtype=torch.float32)
    per_tensor = getattr(engine, "_backward_prologue_per_tensor", None)
    if per_tensor is not None:  # 0.18 and later: a hook on every module output
        measure = lambda: float(per_tensor(probe))  # noqa: E731
    elif engine.is_last_stage():  # before 0.18: backward(loss) on the last stage only
        measure = functools.partial(_prologue_scale, engine, probe)
    else:
        return 1.0
    steps = engine.gradient_accumulation_steps() if accumulation_steps is None else accumulation_steps
    return _with_accumulation_steps(engine, steps, measure)


def _received_gradient_unscaled(grad: torch.Tensor) -> torch.Tensor:
    """A stage before the last passes on the gradient it received as it is
    (0.19's ``PipelineEngine._backward_prologue_per_tensor`` off the last stage)."""
    return grad


def _loss_scaled_for_accumulation(engine: Any, prologue: Callable[..., Any], loss: torch.Tensor,
                                  scale_wrt_gas: bool = True) -> torch.Tensor:
    """The last stage's ``_backward_prologue``, then the division by the
    accumulation steps that upstream's prologue makes for a non-pipeline
    engine (the same condition, the same ``_scale_loss_by_gas``)."""
    loss = prologue(loss, scale_wrt_gas)
    if engine.scale_wrt_gas is not None:
        scale_wrt_gas = engine.scale_wrt_gas
    if scale_wrt_gas and engine.gradient_accumulation_steps() > 1:
        loss = engine._scale_loss_by_gas(loss.float())
    return loss


# The mechanism is seen at this many micro-batches where the config has 1.
_PROBE_STEPS = 2


def correct_gradient_accumulation(engine: Any) -> str | None:
    """Make a pipeline ``engine`` divide by ``gradient_accumulation_steps`` once,
    on the last stage, as DeepSpeed 0.19 does; return what was corrected on this
    stage, as a sentence, or None where the engine already does it.

    What the engine does is measured (:func:`pipeline_gradient_scale`), before
    and after: the correction is an instance attribute over the method that
    scales (the per-output hook off the last stage, or the last stage's loss
    prologue), and it is kept only where the measurement then gives the right
    factor, also for a later ``set_train_batch_size``.

    Raises:
        ConfigError: ``gradient_accumulation_steps``, where this engine scales in
            a way that cannot be corrected here, naming the DeepSpeed version,
            the upstream issues and the first release with the fix.
    """
    steps = max(engine.gradient_accumulation_steps(), _PROBE_STEPS)
    expected = 1.0 / steps if engine.is_last_stage() else 1.0
    found = pipeline_gradient_scale(engine, steps)
    if math.isclose(found, expected, rel_tol=1e-6):
        return None
    stage = engine.stage_id
    if getattr(engine, "_backward_prologue_per_tensor", None) is not None and not engine.is_last_stage():
        engine._backward_prologue_per_tensor = _received_gradient_unscaled
    elif getattr(engine, "_backward_prologue_per_tensor", None) is None and engine.is_last_stage():
        engine._backward_prologue = functools.partial(_loss_scaled_for_accumulation, engine,
                                                      engine._backward_prologue)
    corrected = pipeline_gradient_scale(engine, steps)
    if not math.isclose(corrected, expected, rel_tol=1e-6):
        raise ConfigError(
            "gradient_accumulation_steps", engine.gradient_accumulation_steps(),
            f"1 with DeepSpeed {deepspeed.__version__}",
            f"Pipeline stage {stage} of this DeepSpeed multiplies its gradient by {found:g} for {steps} micro-batches "
            f"where the mean over them needs {expected:g}, and ds_pipe_ckpt cannot correct it here ({corrected:g} "
            f"after its correction): {GRADIENT_ACCUMULATION_FIX}. Upgrade DeepSpeed to 0.19 or later, or "
            "accumulate over one micro-batch per step.")
    return (f"pipeline stage {stage}: DeepSpeed {deepspeed.__version__} multiplies this stage's gradient by "
            f"{found:g} for {steps} micro-batches per step; corrected to {expected:g}, as DeepSpeed 0.19 does "
            f"({GRADIENT_ACCUMULATION_FIX})")
