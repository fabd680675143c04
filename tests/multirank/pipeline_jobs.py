"""Rank functions for the multi-process pipeline tests (module level, so that
``spawn`` can import them)."""

from __future__ import annotations

import deepspeed
import torch
import torch.nn as nn

import pytest

import ds_pipe_ckpt
from ds_pipe_ckpt import LayerSpec, PipelineModule, TiedLayerSpec
from ds_pipe_ckpt.compat import deepspeed_reentrant_runs, engine_inputs_require_grad


def uses_deepspeed_reentrant(case: dict) -> bool:
    """Whether a case checkpoints through DeepSpeed's reentrant checkpoint: it
    checkpoints (an interval from the module, the JSON or set later) and does
    not choose ``use_reentrant: false`` (reentrant is DeepSpeed's default)."""
    interval = case.get("interval") or case.get("config_interval") or case.get("set_interval_later")
    return bool(interval) and case.get("use_reentrant") is not False


def runnable_cases(cases: dict) -> dict:
    """``cases`` less those DeepSpeed cannot run here (its reentrant checkpoint
    on a CPU before 0.19), decided before any rank starts."""
    if deepspeed_reentrant_runs():
        return dict(cases)
    return {name: case for name, case in cases.items() if not uses_deepspeed_reentrant(case)}


def case_params(cases: dict, names) -> list:
    """``names`` as pytest parameters, those of cases DeepSpeed's reentrant
    checkpoint runs marked ``deepspeed_reentrant`` (skipped where it cannot run)."""
    return [pytest.param(name, marks=pytest.mark.deepspeed_reentrant) if uses_deepspeed_reentrant(cases[name])
            else name for name in names]


class CountingReLU(nn.Module):
    """Parameter-free layer that counts its forward calls (recomputations included)."""

    calls = 0

    def forward(self, x):
        CountingReLU.calls += 1
        return torch.relu(x)


HIDDEN = 16


def layer_specs():
    return [
        LayerSpec(nn.Linear, 8, HIDDEN),
        LayerSpec(CountingReLU),
        LayerSpec(nn.Dropout, 0.2),
        LayerSpec(nn.Linear, HIDDEN, HIDDEN),
        LayerSpec(CountingReLU),
        LayerSpec(nn.Linear, HIDDEN, 4),
    ]


class Square(nn.Module):
    """Tied layer: ``forward`` maps HIDDEN -> HIDDEN with the shared weight."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(HIDDEN, HIDDEN) / HIDDEN**0.5)

    def forward(self, x):
        return x @ self.weight


def tied_forward(module, x):
    """Second use of the tied weight, transposed (as an output embedding would be)."""
    return torch.tanh(x @ module.weight.t())


def tied_layer_specs():
    """Layers 1 and 4 share one weight across the two pipeline stages."""
    return [
        LayerSpec(nn.Linear, 8, HIDDEN),
        TiedLayerSpec("shared", Square),
        LayerSpec(CountingReLU),
        LayerSpec(nn.Dropout, 0.1),
        TiedLayerSpec("shared", Square, forward_fn=tied_forward),
        LayerSpec(nn.Linear, HIDDEN, 4),
    ]


# Wide enough that a stage's activations outweigh the planner's fixed margin, so a
# budget can make it checkpoint some layers and store others.
BATCHNORM_HIDDEN = 256


def batchnorm_layer_specs():
    """BatchNorm after each hidden linear (running statistics, num_batches_tracked),
    an in-place ReLU first in a segment."""
    width = BATCHNORM_HIDDEN
    return [
        LayerSpec(nn.Linear, 8, width),
        LayerSpec(nn.BatchNorm1d, width, momentum=0.3),
        LayerSpec(nn.ReLU, inplace=True),
        LayerSpec(nn.Linear, width, width),
        LayerSpec(nn.BatchNorm1d, width),
        LayerSpec(nn.Linear, width, 4),
    ]


MODELS = {"plain": layer_specs, "tied": tied_layer_specs, "batchnorm": batchnorm_layer_specs}


def ds_config(micro_batch, grad_accum, dp, use_reentrant=None, interval=None, activation_checkpointing=None):
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * dp,
        "steps_per_print": 10**9,
        "pipeline": {},
    }
    if use_reentrant is not None:
        config["pipeline"]["use_reentrant"] = use_reentrant
    if interval is not None:
        config["pipeline"]["activation_checkpoint_interval"] = interval
    if activation_checkpointing is not None:
        config["activation_checkpointing"] = activation_checkpointing
    return config


def batches(dp_rank, micro_batch, steps, grad_accum):
    g = torch.Generator().manual_seed(100 + dp_rank)
    n = steps * grad_accum
    xs = torch.randn(n, micro_batch, 8, generator=g)
    ys = xs[..., :4].argmax(dim=-1)  # learnable labels
    return iter(list(zip(xs, ys)))


def train(case, pp, steps=10, micro_batch=16, grad_accum=2):
    """Train one case; return its loss sequence, the recomputation count and the
    mode the module ended up in.

    ``case`` keys: ``init`` ("deepspeed" or "ours"), ``use_reentrant`` (None = absent
    from the JSON), ``interval`` (module argument), ``config_interval`` (JSON), and
    ``set_interval_later`` (call set_checkpoint_interval after initialize), ``model``
    (a key of MODELS), ``checkpointable_layers`` and ``activation_checkpointing`` (the
    JSON section).
    """
    ds_pipe_ckpt.configure()  # defaults; ours re-configures from the JSON
    world = torch.distributed.get_world_size()
    dp = world // pp
    torch.manual_seed(0)
    module = PipelineModule(layers=MODELS[case.get("model", "plain")](), num_stages=pp, loss_fn=nn.CrossEntropyLoss(),
                            partition_method="uniform", seed_layers=True,
                            activation_checkpoint_interval=case.get("interval", 0),
                            checkpointable_layers=case.get("checkpointable_layers"))
    first_weight = next(module.parameters()).detach().clone()
    config = ds_config(micro_batch, grad_accum, dp, case.get("use_reentrant"), case.get("config_interval"),
                       case.get("activation_checkpointing"))
    optimizer = torch.optim.Adam(module.parameters(), lr=0.02)
    init = deepspeed.initialize if case["init"] == "deepspeed" else ds_pipe_ckpt.initialize
    engine, _, _, _ = init(model=module, optimizer=optimizer, config=config)
    if case.get("set_interval_later"):
        module.set_checkpoint_interval(case["set_interval_later"])
    data = batches(engine.grid.get_data_parallel_rank(), micro_batch, steps, grad_accum)
    CountingReLU.calls = 0
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(steps)]
    return {
        "losses": losses,
        "relu_calls": CountingReLU.calls,
        "mode": module.checkpoint_mode,
        "checkpointed_segments": list(module.is_checkpointable_results)
        if module.activation_checkpoint_interval else [],
        "local_layers": [type(f).__name__ for f in module.forward_funcs],
        "micro_batches": steps * grad_accum,
        "initial_first_weight": first_weight,
        "input_requires_grad": engine_inputs_require_grad(engine),
        "params": {name: p.detach().clone() for name, p in module.named_parameters()},
        "buffers": {name: b.clone() for name, b in module.named_buffers()},
        "planned": module.checkpoint_plan is not None,
        "plan_decisions": [d.value for d in module.checkpoint_plan.decisions()] if module.checkpoint_plan else [],
    }


def train_cases(cases, pp, steps=10):
    return {name: train(case, pp, steps) for name, case in cases.items()}


def train_gpt_segments(cases, steps=3, micro_batch=4, grad_accum=2):
    """The GPT example (tied embedding / LM head, position table, blocks with
    dropout, final norm) at pp=2 without ``checkpointable_layers``, one case per
    entry of ``cases`` (keys: ``use_reentrant``, ``interval``, ``checkpointable_layers``,
    ``activation_checkpointing``). Returns per case the losses, the parameters,
    ``segment_checkpointing`` and how many times each segment was checkpointed."""
    from examples.gpt.model import GPTConfig, gpt_layer_specs, language_model_loss
    from ds_pipe_ckpt import pipe

    sizes = GPTConfig(vocab_size=512, context=16, dim=32, heads=2, blocks=2, dropout=0.1)
    results = {}
    for name, case in cases.items():
        ds_pipe_ckpt.configure()
        torch.manual_seed(0)
        module = PipelineModule(layers=gpt_layer_specs(sizes), num_stages=2, loss_fn=language_model_loss,
                                partition_method="uniform", seed_layers=True,
                                checkpointable_layers=case.get("checkpointable_layers"))
        config = ds_config(micro_batch, grad_accum, 1, case.get("use_reentrant"), case.get("interval", 0),
                           case.get("activation_checkpointing"))
        optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
        engine, _, _, _ = ds_pipe_ckpt.initialize(model=module, optimizer=optimizer, config=config)
        g = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, sizes.vocab_size, (steps * grad_accum, micro_batch, sizes.context + 1), generator=g)
        data = iter([(t[:, :-1], t[:, 1:]) for t in tokens])
        calls = {}
        original = pipe.checkpoint_region

        def counting(function, args, kwargs, region, *rest, **keywords):
            label = region.name
            calls[label] = calls.get(label, 0) + 1
            return original(function, args, kwargs, region, *rest, **keywords)

        pipe.checkpoint_region = counting
        try:
            losses = [float(engine.train_batch(data_iter=data)) for _ in range(steps)]
        finally:
            pipe.checkpoint_region = original
        results[name] = {
            "losses": losses,
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "choices": module.segment_checkpointing,
            "calls": calls,
            "micro_batches": steps * grad_accum,
        }
    return results
