"""activation_checkpointing options in non-reentrant mode, in one process: CPU
offload, partitioning over a model-parallel group of one, contiguous buffers,
synchronisation and profiling. (Several ranks: test_partition_distributed.py.)"""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

import ds_pipe_ckpt
from ds_pipe_ckpt import ConfigError
from ds_pipe_ckpt.placement import runtime as partition
from ds_pipe_ckpt.parallel import TensorParallelGroup

SOLO = TensorParallelGroup(group=None, rank=0, world_size=1)

OPTION_SETS = {
    "cpu": dict(checkpoint_in_cpu=True),
    "partition": dict(partition_activations=True),
    "partition_cpu": dict(partition_activations=True, checkpoint_in_cpu=True),
    "partition_contiguous": dict(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=4),
    "everything": dict(partition_activations=True, checkpoint_in_cpu=True, contiguous_checkpointing=True,
                       num_checkpoints=4, synchronize=True, profile=True),
}


def configure(**options):
    return ds_pipe_ckpt.configure(mpu=SOLO, use_reentrant=False, **options)


@pytest.fixture
def block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 6))


def _train_step(block, options, make_inputs, n_checkpoints=3):
    """A chain of checkpointed calls of ``block``; returns (loss, param grads, input grads)."""
    configure(**options)
    block.zero_grad(set_to_none=True)
    inputs = make_inputs()
    h = inputs[0]
    for _ in range(n_checkpoints):
        h = ds_pipe_ckpt.checkpoint(lambda x, *rest: block(x) + sum(r.float().sum() for r in rest), h, *inputs[1:])
    loss = h.pow(2).sum()
    loss.backward()
    return (loss.detach(), [p.grad.clone() for p in block.parameters()],
            [t.grad.clone() for t in inputs if isinstance(t, torch.Tensor) and t.grad is not None])


def _make_inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5, generator=g).t().requires_grad_()  # non-contiguous, 30 elements
    return (x, torch.randn(3, dtype=torch.float64, generator=g, requires_grad=True),
            torch.randint(0, 5, (4, ), generator=g))


@pytest.mark.parametrize("options", list(OPTION_SETS), ids=list(OPTION_SETS))
def test_gradients_are_bitwise_those_of_plain_checkpointing(block, options):
    ref = _train_step(block, {}, _make_inputs)
    got = _train_step(block, OPTION_SETS[options], _make_inputs)
    assert torch.equal(ref[0], got[0])
    for a, b in zip(ref[1] + ref[2], got[1] + got[2], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("options", ["cpu", "partition_contiguous"])
def test_stored_input_is_released_and_callers_copy_untouched(block, options):
    configure(**OPTION_SETS[options])
    base = torch.randn(4, 6, requires_grad=True)
    hidden = base * 2  # an intermediate activation: only the checkpoint would keep it
    kept = base + 1  # one the caller keeps using
    snapshot = kept.detach().clone()
    out = ds_pipe_ckpt.checkpoint(lambda a, b: block(a) * b, hidden, kept)
    alive = weakref.ref(hidden)
    del hidden
    gc.collect()
    assert alive() is None, "the stash still holds the full input"
    assert torch.equal(kept, snapshot)
    (out.sum() + kept.sum()).backward()
    assert torch.equal(kept, snapshot)
    assert base.grad is not None


def test_without_hooks_torch_keeps_the_input(block):
    """The control for the test above: plain non-reentrant checkpointing keeps it."""
    configure()
    hidden = torch.randn(4, 6, requires_grad=True) * 2
    out = ds_pipe_ckpt.checkpoint(block, hidden)
    alive = weakref.ref(hidden)
    del hidden
    gc.collect()
    assert alive() is not None
    out.sum().backward()


def test_offloaded_stash_holds_host_bytes_only():
    configure(checkpoint_in_cpu=True, profile=True)
    x = torch.randn(7, 3) * 1.0
    mask = torch.ones(7, dtype=torch.bool)
    ds_pipe_ckpt.checkpoint(lambda a, m: (a * 2).masked_fill(~m[:, None], 0).sum(), x, mask)
    record = partition.profile_records()[-1]
    assert record.saved_bytes == 7 * 3 * 4 + 7
    assert record.kept_bytes == 7 * 3 * 4 + 7  # the packed floats (host) plus the mask, kept whole


def test_parameters_and_flagged_tensors_stay_whole(block):
    configure(checkpoint_in_cpu=True, profile=True)
    flagged = torch.randn(5, 6)
    flagged.no_checkpointing = True
    weight = block[0].weight
    out = ds_pipe_ckpt.checkpoint(lambda a, w: block(a) + (a @ w.t()).sum(), flagged, weight)
    record = partition.profile_records()[-1]
    assert record.kept_bytes == record.saved_bytes  # nothing packed: no copies at all
    out.sum().backward()


# -- contiguous buffers ---------------------------------------------------------------

def _pool():
    return ds_pipe_ckpt.current_settings().runtime.pool


def _forward(block, n, seed):
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    h = x
    for _ in range(n):
        h = ds_pipe_ckpt.checkpoint(block, h * 1.0)
    return h.sum()


def test_contiguous_buffers_are_reused_across_micro_batches_and_steps(block):
    configure(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3)
    sizes, allocations = [], []
    for step in range(3):
        for micro in range(4):
            loss = _forward(block, 3, seed=step * 4 + micro)
            assert _pool().in_use == 3
            loss.backward()
            assert _pool().in_use == 0, "a recomputed segment did not give its buffer back"
        sizes.append(_pool().allocated_bytes)
        allocations.append(_pool().allocations)
    assert allocations[0] == 3  # three slots, allocated once (one rank: no gather workspace)
    assert allocations == [allocations[0]] * 3 and sizes == [sizes[0]] * 3


def test_too_few_contiguous_buffers_is_a_clear_error(block):
    configure(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    with pytest.raises(ConfigError) as error:
        _forward(block, 3, seed=0)
    message = str(error.value)
    assert "activation_checkpointing.number_checkpoints = 2" in message and "at least 3" in message
    assert "ds_pipe_ckpt.reset()" in message


def test_buffers_of_unused_graphs_return_and_reset_recovers(block):
    configure(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    loss = _forward(block, 2, seed=0)
    del loss  # graph freed without backward: its buffers go back
    gc.collect()
    assert _pool().in_use == 0
    with torch.no_grad():  # evaluation: torch's checkpoint saves nothing, no buffer taken
        _forward(block, 3, seed=1)
    assert _pool().in_use == 0
    kept = _forward(block, 2, seed=2)  # outputs kept, never backpropagated
    with pytest.raises(ConfigError):
        _forward(block, 1, seed=3)
    partition.reset()
    assert _pool().in_use == 0 and _pool().allocated_bytes == 0
    loss = _forward(block, 2, seed=4)
    loss.backward()
    kept.backward()  # the segments from before the reset still have their (now private) buffers


def test_backward_twice_needs_non_contiguous_buffers(block):
    configure(partition_activations=True)
    loss = _forward(block, 2, seed=0)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in block.parameters()]
    loss.backward()
    assert all(torch.equal(p.grad, 2 * g) for p, g in zip(block.parameters(), first))

    configure(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    loss = _forward(block, 2, seed=0)
    loss.backward(retain_graph=True)
    with pytest.raises(torch_checkpoint.CheckpointError, match="contiguous_memory_optimization"):
        loss.backward()


# -- synchronisation and profiling ----------------------------------------------------

class _CountingAccelerator:
    def __init__(self):
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1


def test_synchronize_checkpoint_boundary(monkeypatch, block):
    accelerator = _CountingAccelerator()
    monkeypatch.setattr(partition, "get_accelerator", lambda: accelerator)
    configure(synchronize=True)
    x = torch.randn(2, 6, requires_grad=True)
    out = ds_pipe_ckpt.checkpoint(block, x)
    assert accelerator.synchronized == 2  # forward start and end
    out.sum().backward()
    assert accelerator.synchronized == 4  # and recomputation start and end

    configure(synchronize=True, checkpoint_in_cpu=True)
    accelerator.synchronized = 0
    ds_pipe_ckpt.checkpoint(block, x).sum().backward()
    assert accelerator.synchronized == 5  # and the start of the restore of the inputs


def test_profile_records_and_logs_each_phase(caplog, block):
    configure(checkpoint_in_cpu=True, profile=True)
    x = torch.randn(2, 6, requires_grad=True)

    def segment(a):
        return block(a)

    with caplog.at_level(logging.INFO, logger="ds_pipe_ckpt"):
        out = ds_pipe_ckpt.checkpoint(segment, x * 1.0)
        out.sum().backward()
    record = partition.profile_records()[-1]
    assert "segment" in record.label
    assert all(v is not None and v >= 0 for v in (record.forward_s, record.gather_s, record.recompute_s))
    assert record.saved_bytes == record.kept_bytes == 2 * 6 * 4  # in host memory, not partitioned
    phases = [m for m in caplog.messages if m.startswith(f"checkpoint {record.index} ")]
    assert [p.rsplit("(", 1)[1] for p in phases] == ["forward done)", "gather done)", "recompute done)"]


@pytest.mark.parametrize("options", [{}, {"partition_activations": True}], ids=["nothing", "partition_over_one_rank"])
def test_no_placement_when_nothing_needs_it(options):
    """Partitioning over a group of one rank would only copy the inputs: it is a no-op."""
    configure(**options)
    settings = ds_pipe_ckpt.current_settings()
    assert partition.placement_for(settings) is None
    assert partition.profile_records() == []


def test_non_reentrant_options_need_no_process_group_but_reentrant_ones_do(monkeypatch):
    # As in a process where torch.distributed was never initialised (other tests
    # of this session may have initialised a one-rank group).
    monkeypatch.setattr(ds_pipe_ckpt.settings.ds_comm, "is_initialized", lambda: False)
    settings = ds_pipe_ckpt.configure(use_reentrant=False, checkpoint_in_cpu=True, profile=True)
    assert settings.config.cpu_checkpointing
    with pytest.raises(ConfigError, match="activation_checkpointing.cpu_checkpointing"):
        ds_pipe_ckpt.configure(use_reentrant=True, checkpoint_in_cpu=True)
