"""Partitioned and CPU-offloaded checkpoint inputs on 2 and 4 CPU ranks (gloo):
outputs and gradients bitwise equal to the unpartitioned run, one
``all_gather_single`` per checkpointed segment, and a 2-stage x mp=2
pipeline whose training is bitwise that of the unpartitioned one.

One launch per world size runs every case (process start-up dominates).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import deepspeed
import ds_pipe_ckpt
from ds_pipe_ckpt import upstream_checkpointing
from ds_pipe_ckpt.compat import ALL_GATHER_SINGLE
from ds_pipe_ckpt.settings import restore_defaults
from ds_pipe_ckpt.testing import run_ranks

# ---------------------------------------------------------------------------------
# Rank side (module level so that spawned ranks can import it)


class CollectiveCounter:
    """Counts the collectives this process issues, by name."""

    # This torch's (ds_pipe_ckpt.compat): all_gather_single from 2.14, all_gather_into_tensor before.
    NAMES = tuple(name for name in ("all_gather_single", "all_gather_into_tensor", "all_gather", "broadcast",
                                    "all_reduce", "reduce_scatter_tensor") if hasattr(dist, name))

    def __init__(self):
        self.counts = dict.fromkeys(self.NAMES, 0)
        for name in self.NAMES:
            original = getattr(dist, name)

            def counted(*args, _original=original, _name=name, **kwargs):
                self.counts[_name] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def take(self) -> dict:
        counts, self.counts = self.counts, dict.fromkeys(self.NAMES, 0)
        return counts


class ModelParallelUnit:
    """A Megatron-style mpu over all ranks."""

    def __init__(self):
        self.group = dist.new_group(list(range(dist.get_world_size())))

    def get_model_parallel_group(self):
        return self.group

    def get_model_parallel_rank(self):
        return dist.get_rank(self.group)

    def get_model_parallel_world_size(self):
        return dist.get_world_size(self.group)


def _mlp(width_in, width_out):
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(width_in, 16), nn.GELU(), nn.Linear(16, width_out))


def case_odd_sizes():
    net = _mlp(7, 5)

    def fn(x, y):
        return net(x) * y.sum()

    # 21 and 5 elements: not divisible by 2 or 4.
    return net, fn, lambda: (torch.randn(3, 7, requires_grad=True), torch.randn(5, requires_grad=True))


def case_non_contiguous():
    net = _mlp(6, 6)

    def fn(transposed, strided, channels_last):
        return net(transposed) + net(strided).sum() + channels_last.sum(dim=(0, 2, 3)).mean()

    def make():
        base = torch.randn(6, 5, requires_grad=True)
        wide = torch.randn(5, 12, requires_grad=True)
        image = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last).requires_grad_()
        return base.t(), wide[:, ::2], image  # dense permuted, gapped, channels-last

    return net, fn, make


def case_mixed_dtypes():
    net = _mlp(8, 4)

    def fn(x32, x64, xbf16, index, mask):
        h = net(x32 + x64.float() + xbf16.float())
        return h[index].masked_fill(~mask, 0.0), (x64 * 2).sum(), xbf16 * 3

    def make():
        return (torch.randn(5, 8, requires_grad=True), torch.randn(5, 8, dtype=torch.float64, requires_grad=True),
                torch.randn(5, 8, dtype=torch.bfloat16, requires_grad=True), torch.tensor([4, 0, 2]),
                torch.rand(3, 4) > 0.5)

    return net, fn, make


def case_non_tensors_and_tiny():
    net = _mlp(4, 4)

    def fn(x, scale, nothing, tag, one, scalar):
        assert nothing is None and tag == "tag"
        return net(x) * scale * one + scalar, tag

    def make():
        return (torch.randn(9, 4, requires_grad=True), 3, None, "tag", torch.randn(1, requires_grad=True),
                torch.tensor(2.5, requires_grad=True))

    return net, fn, make


def case_input_used_elsewhere():
    """The same tensor twice, a parameter as input, and an input used after the checkpoint."""
    net = _mlp(4, 4)

    def fn(x, again, weight):
        return net(x) + (again @ weight).sum(-1, keepdim=True)

    def make():
        return (torch.randn(3, 4, requires_grad=True) * 1.0, None, net[0].weight[:4, :4].detach().clone())

    return net, fn, make


CASES = {
    "odd_sizes": case_odd_sizes,
    "non_contiguous": case_non_contiguous,
    "mixed_dtypes": case_mixed_dtypes,
    "non_tensors_and_tiny": case_non_tensors_and_tiny,
    "input_used_elsewhere": case_input_used_elsewhere,
}

OPTIONS = {
    "partition": dict(partition_activations=True),
    "partition_cpu": dict(partition_activations=True, checkpoint_in_cpu=True),
    "partition_contiguous": dict(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2),
    "partition_cpu_contiguous": dict(partition_activations=True, checkpoint_in_cpu=True,
                                     contiguous_checkpointing=True, num_checkpoints=2),
    "cpu": dict(checkpoint_in_cpu=True),
}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _run_case(name, mpu, options, counter):
    """Forward and backward of one case under ``options``; return its outputs,
    gradients (parameters, then inputs) and the collectives issued."""
    ds_pipe_ckpt.configure(mpu=mpu, use_reentrant=False, **options)
    net, fn, make = CASES[name]()
    torch.manual_seed(11)
    inputs = list(make())
    if name == "input_used_elsewhere":
        inputs[1] = inputs[0]  # the same tensor twice
        inputs[2] = net[2].weight  # a parameter as input
    inputs = tuple(inputs)
    snapshot = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    counter.take()
    out = ds_pipe_ckpt.checkpoint(fn, *inputs)
    # Inputs used again after the checkpoint must be intact.
    extra = sum(t.float().sum() for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point())
    loss = sum((t.float() * (i + 1)).sum() for i, t in enumerate(_tensors(out)) if t.requires_grad) + extra
    loss.backward()
    collectives = counter.take()
    intact = all(torch.equal(a, b) for a, b in zip(inputs, snapshot) if isinstance(a, torch.Tensor))
    grads = [p.grad for p in net.parameters()] + [t.grad for t in inputs if isinstance(t, torch.Tensor)]
    return {
        "outputs": [t.detach() for t in _tensors(out)],
        "grads": [None if g is None else g.clone() for g in grads],
        "collectives": collectives,
        "inputs_intact": intact,
    }


def _chain(mpu, options, counter, micro_batches=2, steps=2):
    """Three checkpointed blocks in a row, several micro-batches and steps; return
    the gradients, the collectives and (contiguous buffers) the pool's size per step."""
    ds_pipe_ckpt.configure(mpu=mpu, use_reentrant=False, **options)
    torch.manual_seed(3)
    blocks = [nn.Sequential(nn.Linear(10, 10), nn.Tanh()) for _ in range(3)]
    counter.take()
    pool_bytes, released = [], []
    for step in range(steps):
        for block in blocks:
            block.zero_grad()
        for micro in range(micro_batches):
            x = torch.randn(4, 10, generator=torch.Generator().manual_seed(step * 10 + micro), requires_grad=True)
            h = x
            refs = []
            for block in blocks:
                segment_input = h * 1.0  # held by nothing but the checkpoint
                refs.append(weakref.ref(segment_input))
                h = ds_pipe_ckpt.checkpoint(block, segment_input)
                del segment_input
            out = h.square().sum()
            del h
            gc.collect()
            # Segment inputs are no longer held once stored (partitioned/offloaded).
            released.append(sum(r() is None for r in refs))
            out.backward()
        runtime = ds_pipe_ckpt.current_settings().runtime
        pool_bytes.append(runtime.pool.allocated_bytes if runtime is not None and runtime.pool else 0)
    return {
        "grads": [p.grad.clone() for b in blocks for p in b.parameters()],
        "collectives": counter.take(),
        "pool_bytes": pool_bytes,
        "released": released,
    }


def partition_rank_job(counter=None):
    torch.manual_seed(0)
    counter = counter or CollectiveCounter()
    mpu = ModelParallelUnit()
    results = {}
    for name in CASES:
        results[(name, "reference")] = _run_case(name, None, {}, counter)
        for option, values in OPTIONS.items():
            results[(name, option)] = _run_case(name, mpu, values, counter)
    results[("chain", "reference")] = _chain(None, {}, counter)
    for option in ("partition", "partition_cpu_contiguous", "cpu"):
        values = dict(OPTIONS[option])
        if "num_checkpoints" in values:
            values["num_checkpoints"] = 3
        results[("chain", option)] = _chain(mpu, values, counter)
    ds_pipe_ckpt.configure()
    return results


# ---------------------------------------------------------------------------------
# Pipeline: 2 stages x mp=2


class Scale(nn.Module):
    def forward(self, x):
        return x * 1.5


class StackModelParallelUnit:
    """A training stack's mpu (Megatron's names) over a pipeline grid's model-parallel slice."""

    def __init__(self, grid):
        self.grid = grid

    def get_tensor_model_parallel_group(self):
        return self.grid.get_slice_parallel_group()

    def get_tensor_model_parallel_rank(self):
        return self.grid.get_slice_parallel_rank()

    def get_tensor_model_parallel_world_size(self):
        return self.grid.get_slice_parallel_world_size()

    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size

    def get_data_parallel_group(self):
        return self.grid.get_data_parallel_group()

    def get_data_parallel_rank(self):
        return self.grid.get_data_parallel_rank()

    def get_data_parallel_world_size(self):
        return self.grid.get_data_parallel_world_size()


STACK_KEYS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization", "number_checkpoints",
              "synchronize_checkpoint_boundary", "use_reentrant")


def pipeline_rank_job(counter=None, steps=3):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from ds_pipe_ckpt import LayerSpec, PipelineModule

    counter = counter or CollectiveCounter()
    results = {}
    contiguous = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
                  "number_checkpoints": 6}
    for name, section in (("reference", {}), ("partition", {"partition_activations": True}),
                          ("partition_cpu_contiguous", contiguous),
                          # Configured in code as the stacks do, the JSON without the section:
                          # GPT-NeoX before initialize, Megatron-DeepSpeed (with its JSON) after.
                          ("neox_style", {}), ("megatron_style", {})):
        restore_defaults()
        torch.manual_seed(0)
        layers = [LayerSpec(nn.Linear, 8, 15), LayerSpec(nn.Tanh), LayerSpec(Scale),
                  LayerSpec(nn.Linear, 15, 15), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 15, 3)]
        module = PipelineModule(layers=layers, topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1),
                                loss_fn=nn.CrossEntropyLoss(), partition_method="uniform",
                                activation_checkpoint_interval=1)
        config = {"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 2, "train_batch_size": 10,
                  "steps_per_print": 10**9,
                  # DeepSpeed's own partitioning of the activations sent between stages
                  # (PartitionedTensor.from_meta) fails for sizes not divisible by mp (here 5 x 15).
                  "pipeline": {"use_reentrant": False, "pipe_partitioned": False, "grad_partitioned": False},
                  "activation_checkpointing": section}
        stack_mpu = StackModelParallelUnit(module.mpu())
        if name == "neox_style":
            deepspeed.checkpointing.configure(stack_mpu, partition_activations=True, contiguous_checkpointing=False,
                                              num_checkpoints=6, checkpoint_in_cpu=True, synchronize=True,
                                              profile=False)
        engine, _, _, _ = ds_pipe_ckpt.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                                                  config=config)
        if name == "megatron_style":
            deepspeed.checkpointing.configure(stack_mpu, deepspeed_config={**config, "activation_checkpointing": {
                "contiguous_memory_optimization": True, "number_checkpoints": 6}}, partition_activations=True,
                checkpoint_in_cpu=True)
        g = torch.Generator().manual_seed(5)
        data = iter([(torch.randn(5, 8, generator=g), torch.randint(0, 3, (5, ), generator=g))
                     for _ in range(2 * steps)])
        counter.take()
        losses = []
        for _ in range(steps):
            losses.append(float(engine.train_batch(data_iter=data)))
            deepspeed.checkpointing.reset()  # GPT-NeoX does, every step
        settings = ds_pipe_ckpt.current_settings()
        results[name] = {
            "settings": {key: getattr(settings.config, key) for key in STACK_KEYS},
            "deepspeed_module": upstream_checkpointing.snapshot().fields(),
            "mpu_is_the_stacks": settings.model_parallel.mpu is stack_mpu,
            "losses": losses,
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "gathers": counter.take()[ALL_GATHER_SINGLE],
            "stage": module.stage_id,
            "segments": sum(module.is_checkpointable_results),
            "micro_batches": 2 * steps,
            "mp_world_size": ds_pipe_ckpt.current_settings().model_parallel.world_size,
        }
    restore_defaults()
    return results


def four_rank_job():
    """mp=4 cases, then the 2-stage x mp=2 pipeline, in one launch (start-up dominates)."""
    counter = CollectiveCounter()
    return {"partition": partition_rank_job(counter), "pipeline": pipeline_rank_job(counter)}


# ---------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def four_rank_runs():
    return run_ranks(four_rank_job, 4, timeout=900)


@pytest.fixture(scope="module", params=[2, 4], ids=["mp2", "mp4"])
def partition_runs(request, four_rank_runs):
    if request.param == 4:
        return 4, [result["partition"] for result in four_rank_runs]
    return 2, run_ranks(partition_rank_job, 2, timeout=600)


def _assert_same(ref, got, what):
    assert len(ref) == len(got), f"{what}: {len(ref)} vs {len(got)} tensors"
    for i, (a, b) in enumerate(zip(ref, got)):
        assert (a is None) == (b is None), f"{what} {i}: presence differs"
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, f"{what} {i}: metadata differs"
            assert torch.equal(a, b), f"{what} {i}: differs by {(a.double() - b.double()).abs().max()}"


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_gradients_are_exact(partition_runs, case, option):
    world, results = partition_runs
    for rank, result in enumerate(results):
        ref, got = result[(case, "reference")], result[(case, option)]
        _assert_same(ref["outputs"], got["outputs"], f"mp={world} rank {rank} {case}/{option} output")
        _assert_same(ref["grads"], got["grads"], f"mp={world} rank {rank} {case}/{option} gradient")
        assert got["inputs_intact"], f"rank {rank}: an input was modified"


@pytest.mark.parametrize("option", list(OPTIONS))
def test_one_collective_per_checkpointed_segment(partition_runs, option):
    _, results = partition_runs
    expected = 1 if "partition" in option else 0
    for rank, result in enumerate(results):
        for case in CASES:
            counts = result[(case, option)]["collectives"]
            assert counts[ALL_GATHER_SINGLE] == expected, (rank, case, counts)
            assert sum(counts.values()) == expected, (rank, case, counts)


@pytest.mark.parametrize("option", ["partition", "partition_cpu_contiguous", "cpu"])
def test_chain_of_checkpoints(partition_runs, option):
    _, results = partition_runs
    for rank, result in enumerate(results):
        ref, got = result[("chain", "reference")], result[("chain", option)]
        _assert_same(ref["grads"], got["grads"], f"rank {rank} chain/{option} gradient")
        # 3 segments x 2 micro-batches x 2 steps, one gather each when partitioned.
        assert got["collectives"][ALL_GATHER_SINGLE] == (12 if "partition" in option else 0)
        # The segments' inputs are held by nothing else: their memory is released.
        assert got["released"] == [3, 3, 3, 3]
        assert ref["released"] == [0, 0, 0, 0]  # torch alone keeps them
        if "contiguous" in option:
            assert got["pool_bytes"][0] > 0 and got["pool_bytes"][1] == got["pool_bytes"][0], got["pool_bytes"]


@pytest.fixture(scope="module")
def pipeline_runs(four_rank_runs):
    return [result["pipeline"] for result in four_rank_runs]


@pytest.mark.parametrize("option", ["partition", "partition_cpu_contiguous", "neox_style", "megatron_style"])
def test_pipeline_2_stages_x_mp2_trains_exactly(pipeline_runs, option):
    for rank, result in enumerate(pipeline_runs):
        ref, got = result["reference"], result[option]
        assert got["mp_world_size"] == 2
        assert got["losses"] == ref["losses"], f"rank {rank}: losses differ"
        for name, value in ref["params"].items():
            assert torch.equal(got["params"][name], value), f"rank {rank}: parameter {name} differs"
        # One gather per recomputed segment and micro-batch. Stage 0's Scale segment
        # saves nothing, so it is never recomputed and never gathers.
        assert got["segments"] == 3
        recomputed = {0: 2, 1: 3}[got["stage"]]
        assert got["gathers"] == recomputed * got["micro_batches"], (rank, got["gathers"])
        assert ref["gathers"] == 0


@pytest.mark.parametrize("option", ["neox_style", "megatron_style"])
def test_settings_a_stack_made_in_code_are_in_force(pipeline_runs, option):
    """deepspeed.checkpointing.configure before (GPT-NeoX) or after (Megatron-DeepSpeed)
    ds_pipe_ckpt.initialize, whose JSON has no activation_checkpointing section:
    the stack's values and mpu govern ds_pipe_ckpt's checkpoint (its partitioning
    gathered above) and DeepSpeed's module alike, after reset() every step."""
    expected = {"partition_activations": True, "cpu_checkpointing": True, "number_checkpoints": 6,
                "contiguous_memory_optimization": option == "megatron_style",
                "synchronize_checkpoint_boundary": option == "neox_style", "use_reentrant": False}
    for rank, result in enumerate(pipeline_runs):
        got = result[option]
        assert got["settings"] == expected, f"rank {rank}: {got['settings']}"
        assert got["mpu_is_the_stacks"], f"rank {rank}: partitioned over another unit than the stack's"
        upstream = {**{key: value for key, value in expected.items() if key != "use_reentrant"}, "profile": False}
        assert got["deepspeed_module"] == upstream, f"rank {rank}: DeepSpeed's module holds {got['deepspeed_module']}"
        assert result["reference"]["deepspeed_module"]["partition_activations"] is False
