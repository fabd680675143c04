"""The norm that clips a pipeline's fp32 gradients: the whole model's, over every stage.

With ``gradient_clipping`` set and the engine's plain fp32 path (no ZeRO, no
bf16 or fp16), DeepSpeed's ``DeepSpeedEngine.clip_fp32_gradients`` calls
``deepspeed.runtime.utils.clip_grad_norm_`` with the pipeline grid as ``mpu``.
That counts a parameter only where ``mpu.get_model_parallel_rank() == 0`` (or
the parameter is tensor-parallel), and the grid's model-parallel rank is the
rank inside the whole pipe x tensor slice: every stage but the first is left
out of the norm, so each stage's update is clipped by stage 0's norm. The
bf16, fp16 and ZeRO paths of the same engine count every stage (tied weights
once, by DeepSpeed's ``ds_pipe_replicated`` mark, and tensor-parallel
replicas once) and are left as they are.

:func:`install` gives a pipeline engine's fp32 path that norm: each stage's
part by ``torch.nn.utils.get_total_norm``, summed over the grid's
model-parallel group, and the clip by ``torch.nn.utils.clip_grads_with_norm_``,
so the update equals the model's without a pipeline clipped by
``torch.nn.utils.clip_grad_norm_``. Data-parallel replicas hold the same
(already averaged) gradients when the step clips, so they need no reduction.
This module must not change any other path of the engine.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import bwc_tensor_model_parallel_rank, is_model_parallel_parameter

__all__ = ["pipeline_gradient_norm", "clip_pipeline_gradients", "install"]


def _counted_here(parameter: torch.nn.Parameter, tensor_rank: int) -> bool:
    """Whether this rank's copy of ``parameter`` is the one the norm counts: a
    tied weight on its first stage only, a tensor-parallel replica on tensor
    rank 0 only, a tensor-parallel shard everywhere."""
    if getattr(parameter, "ds_pipe_replicated", False):
        return False
    return tensor_rank == 0 or is_model_parallel_parameter(parameter)


def pipeline_gradient_norm(parameters: Sequence[torch.nn.Parameter], mpu: Any) -> torch.Tensor:
    """The 2-norm of the gradients of the whole pipelined model (float32), the
    same on every rank of ``mpu``'s model-parallel group; ``parameters`` are this
    rank's. Parameters without a gradient count as zero."""
    tensor_rank = bwc_tensor_model_parallel_rank(mpu=mpu)
    grads = [p.grad for p in parameters if p.grad is not None and _counted_here(p, tensor_rank)]
    if grads:
        squared = torch.nn.utils.get_total_norm(grads, norm_type=2.0).float().square()
    else:  # a stage with no gradients still takes part in the sum
        squared = torch.zeros((), dtype=torch.float32, device=get_accelerator().current_device_name())
    if mpu is not None and dist.is_initialized():
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
    return squared.sqrt()


def clip_pipeline_gradients(engine: Any) -> torch.Tensor:
    """Clip this stage's gradients by the whole model's norm to
    ``engine.gradient_clipping()``; return the norm."""
    parameters = [p for p in engine.module.parameters() if p.grad is not None]
    norm = pipeline_gradient_norm(parameters, engine.mpu)
    if parameters:
        torch.nn.utils.clip_grads_with_norm_(parameters, engine.gradient_clipping(), norm)
    return norm


def install(engine: Any) -> bool:
    """Make ``engine``'s fp32 clipping (``clip_fp32_gradients``, which DeepSpeed's
    ``_take_model_step`` calls only on that path) use the whole model's norm.
    Not for a model with mixture-of-experts layers, whose expert gradients
    differ between data-parallel replicas (upstream averages its norm over
    them): returns False and leaves the engine as it is there."""
    if getattr(engine, "has_moe_layers", False):
        return False
    engine.clip_fp32_gradients = functools.partial(clip_pipeline_gradients, engine)
    return True
