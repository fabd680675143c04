"""Profiling a pipeline's layer list before any stage exists
(ds_pipe_ckpt.planning.layer_profiling): the figures of torch's layers
against hand-computed bytes, tied layers, and the chain planned by the
stage-boundary planner."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from ds_pipe_ckpt.planning.layer_profiling import profile_layer_specs
from ds_pipe_ckpt.planning.partition import plan_partition

F32 = 4


def test_linear_gelu_linear_bytes_as_autograd_saves_them():
    """Linear(16, 32) on [4, 16] saves its input (256 B); GELU on [4, 32]
    saves its input (512 B); Linear(32, 8) saves its input (512 B). Gradients:
    (16 * 32 + 32) and (32 * 8 + 8) floats."""
    specs = [LayerSpec(nn.Linear, 16, 32), LayerSpec(nn.GELU), LayerSpec(nn.Linear, 32, 8)]
    chain = profile_layer_specs(specs, torch.randn(4, 16))
    figures = [(p.input_bytes, p.saved_bytes, p.input_saved_bytes, p.grad_bytes) for p in chain.layers]
    assert figures == [(64 * F32, 64 * F32, 64 * F32, (16 * 32 + 32) * F32),
                       (128 * F32, 128 * F32, 128 * F32, 0),
                       (128 * F32, 128 * F32, 128 * F32, (32 * 8 + 8) * F32)]
    assert chain.output_bytes == 4 * 8 * F32
    assert all(p.forward_s > 0 for p in chain.layers) and all(t > 0 for t in chain.backward_s)
    assert [p.name for p in chain.layers] == ["layer 0 (Linear)", "layer 1 (GELU)", "layer 2 (Linear)"]


def test_tied_layers_are_built_once_and_counted_at_each_use():
    """An embedding (10 x 8) used again as the head: one module, its gradient
    counted on both (they may land on different stages)."""
    built = []

    class Embedding(nn.Embedding):
        def __init__(self, *args):
            super().__init__(*args)
            built.append(self)

    specs = [TiedLayerSpec("embed", Embedding, 10, 8), LayerSpec(nn.Linear, 8, 8),
             TiedLayerSpec("embed", Embedding, 10, 8, forward_fn=lambda module, h: h @ module.weight.t())]
    tokens = torch.randint(0, 10, (4, 5))
    chain = profile_layer_specs(specs, tokens)
    assert len(built) == 1
    assert chain.layers[0].grad_bytes == chain.layers[2].grad_bytes == 10 * 8 * F32
    assert chain.layers[0].input_bytes == tokens.numel() * 8  # int64 token ids
    assert chain.output_bytes == 4 * 5 * 10 * F32


def test_the_profiled_chain_plans_its_stage_boundaries():
    specs = [LayerSpec(nn.Linear, 32, 64)] + [LayerSpec(nn.Sequential, nn.Linear(64, 256), nn.GELU(),
                                                        nn.Linear(256, 64)) for _ in range(4)]
    chain = profile_layer_specs(specs, torch.randn(16, 32))
    problem = chain.partition_problem(stages=2, micro_batches=4, budget_bytes=[2**20, 2**20])
    plan = plan_partition(problem)
    assert plan.boundaries[0] == 0 and plan.boundaries[-1] == len(specs) and len(plan.stage_plans) == 2


def test_a_layer_whose_output_needs_no_gradient_is_named():
    """sin saves its input for its backward, which never runs on a detached
    output: what recomputing the layer costs cannot be measured. (A layer
    that saves nothing, such as a bare detach, is simply free to store.)"""
    specs = [LayerSpec(nn.Linear, 4, 4), lambda x: torch.sin(x).detach()]
    with pytest.raises(ValueError, match=r"layer 1 \(<lambda>\)'s output does not reach a backward"):
        profile_layer_specs(specs, torch.randn(2, 4))
