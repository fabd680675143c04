"""Rank functions for the gradient-parity tests: a pipeline's step against the
same layers without a pipeline (ds_pipe_ckpt.parity), module level for spawn."""

from __future__ import annotations

import deepspeed
import torch
import torch.nn as nn

import ds_pipe_ckpt
from ds_pipe_ckpt import LayerSpec, TiedLayerSpec
from ds_pipe_ckpt.parity import check_gradient_parity

WIDTH = 16
CLASSES = 4


def mlp_layers(depth=15):
    """The issue's model: Linear/Tanh pairs, as an nn.Sequential would hold them."""
    layers = [LayerSpec(nn.Linear, 8, WIDTH)]
    while len(layers) < depth - 1:
        layers += [LayerSpec(nn.Tanh), LayerSpec(nn.Linear, WIDTH, WIDTH)]
    return layers[:depth - 1] + [LayerSpec(nn.Linear, WIDTH, CLASSES)]


class Embedding(nn.Module):
    """Tied input/output projection (as a language model ties its embedding and head)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, 8) / 8**0.5)

    def forward(self, x):
        return x @ self.weight.t()


def head(module, x):
    return (x @ module.weight)[..., :CLASSES]


def tied_layers():
    return [TiedLayerSpec("embed", Embedding), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, WIDTH, WIDTH),
            LayerSpec(nn.ReLU, inplace=True), LayerSpec(nn.Linear, WIDTH, WIDTH), LayerSpec(nn.Tanh),
            TiedLayerSpec("embed", Embedding, forward_fn=head)]


def wide_layers():
    """Wide enough that a stage's activations outweigh what a budget cannot
    control, so that a planner under a budget stores some layers and checkpoints others."""
    width = 256
    layers = [LayerSpec(nn.Linear, 8, width)]
    for _ in range(5):
        layers += [LayerSpec(nn.Tanh), LayerSpec(nn.Linear, width, width)]
    return layers + [LayerSpec(nn.Linear, width, CLASSES)]


MODELS = {"mlp": mlp_layers, "tied": tied_layers, "wide": wide_layers}


def micro_batches(count, micro_batch):
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(count, micro_batch, 8, generator=g)
    return [(x, x[..., :CLASSES].argmax(dim=-1)) for x in xs]


def config(grad_accum, dp, micro_batch, use_reentrant=None, clip=None, zero=None, bf16=False,
           activation_checkpointing=None):
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": grad_accum,
           "train_batch_size": micro_batch * grad_accum * dp, "steps_per_print": 10**9, "pipeline": {}}
    if use_reentrant is not None:
        cfg["pipeline"]["use_reentrant"] = use_reentrant
    if clip is not None:
        cfg["gradient_clipping"] = clip
    if zero is not None:
        cfg["zero_optimization"] = {"stage": zero}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if activation_checkpointing is not None:
        cfg["activation_checkpointing"] = activation_checkpointing
    return cfg


LOSSES = {"mean": nn.CrossEntropyLoss(), "sum": nn.CrossEntropyLoss(reduction="sum")}


def parity(case, pp):
    """One case's ParityReport. ``case`` keys: ``ga``, ``model`` (MODELS), ``loss``
    (LOSSES), ``interval``, ``use_reentrant``, ``checkpointable_layers``, ``clip``,
    ``zero``, ``bf16``, ``activation_checkpointing`` (the JSON section), ``steps``,
    ``init`` ("ours" or "deepspeed")."""
    ds_pipe_ckpt.configure()
    dp = torch.distributed.get_world_size() // pp
    ga, steps = case.get("ga", 4), case.get("steps", 1)
    micro_batch = case.get("micro_batch", 2)
    cfg = config(ga, dp, micro_batch, use_reentrant=case.get("use_reentrant"), clip=case.get("clip"), zero=case.get("zero"),
                 bf16=case.get("bf16", False), activation_checkpointing=case.get("activation_checkpointing"))
    kwargs = {}
    if case.get("checkpointable_layers") is not None:
        kwargs["checkpointable_layers"] = case["checkpointable_layers"]
    init = deepspeed.initialize if case.get("init") == "deepspeed" else None
    return check_gradient_parity(MODELS[case.get("model", "mlp")](), LOSSES[case.get("loss", "mean")],
                                 micro_batches(steps * ga * dp, micro_batch), cfg, num_stages=pp, steps=steps,
                                 activation_checkpoint_interval=case.get("interval", 0), initialize=init, **kwargs)


def parity_cases(cases, pp):
    return {name: parity(case, pp) for name, case in cases.items()}


def probe_scales(pp, ga):
    """What each stage's engine multiplies its gradient by, before ds_pipe_ckpt's
    correction and after (gradient_accumulation.pipeline_gradient_scale)."""
    from ds_pipe_ckpt.gradient_accumulation import pipeline_gradient_scale

    ds_pipe_ckpt.configure()
    layers = mlp_layers(5)
    module = ds_pipe_ckpt.PipelineModule(layers=layers, num_stages=pp, loss_fn=nn.CrossEntropyLoss(),
                                         partition_method="uniform")
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    cfg = config(ga, torch.distributed.get_world_size() // pp, 2)
    plain_engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=cfg)
    before = pipeline_gradient_scale(plain_engine)
    module = ds_pipe_ckpt.PipelineModule(layers=layers, num_stages=pp, loss_fn=nn.CrossEntropyLoss(),
                                         partition_method="uniform")
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    engine, *_ = ds_pipe_ckpt.initialize(model=module, optimizer=optimizer, config=cfg)
    return {"stage": engine.stage_id, "before": before, "after": pipeline_gradient_scale(engine)}
