"""The classifier head's tensor parallelism: the copy-to / reduce-from autograd
functions, column- and row-parallel linears, and the tracker-drawn dropout."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import cifar10_tp_jobs
from ds_pipe_ckpt.testing import run_ranks

from examples.cifar10.model import TensorParallelClassifier, alexnet_layers
from examples.cifar10.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallelDropout,
                                              seed_model_parallel_rng)


@pytest.fixture(scope="module")
def two_rank_results():
    return run_ranks(cifar10_tp_jobs.two_rank_checks, 2, timeout=300)


def test_copy_to_region_is_identity_forward_and_sums_gradients(two_rank_results):
    for rank, result in enumerate(two_rank_results):
        regions = result["regions"]
        assert torch.equal(regions["copied"], torch.full((2, 3), float(rank + 1)))
        assert torch.equal(regions["copy_grad"], torch.full((2, 3), 30.0))  # 10 + 20


def test_reduce_from_region_sums_forward_and_passes_gradients(two_rank_results):
    for rank, result in enumerate(two_rank_results):
        regions = result["regions"]
        assert torch.equal(regions["reduced"], torch.full((2, 3), 3.0))  # 1 + 2
        assert torch.equal(regions["reduce_grad"], torch.full((2, 3), 10.0 * (rank + 1)))


def test_tensor_parallel_model_equals_unsharded_forward_and_backward(two_rank_results):
    for rank, result in enumerate(two_rank_results):
        tp, full = result["model"]["tp"], result["model"]["full"]
        torch.testing.assert_close(tp["logits"], full["logits"])
        torch.testing.assert_close(tp["input_grad"], full["input_grad"])
        # The replicated convolution gets the full gradient on every rank
        # (copy-to all-reduces the head's input gradient).
        torch.testing.assert_close(tp["conv1_weight_grad"], full["conv1_weight_grad"])
        rows = slice(rank * 4, (rank + 1) * 4)  # hidden 8 over 2 ranks
        assert torch.equal(tp["fc1_weight"], full["fc1_weight"][rows])
        torch.testing.assert_close(tp["fc1_weight_grad"], full["fc1_weight_grad"][rows])
        assert torch.equal(tp["fc2_weight"], full["fc2_weight"][:, rows])
        torch.testing.assert_close(tp["fc2_weight_grad"], full["fc2_weight_grad"][:, rows])
        torch.testing.assert_close(tp["fc2_bias_grad"], full["fc2_bias_grad"])


def test_dropout_masks_differ_across_tensor_parallel_ranks_and_repeat_per_seed(two_rank_results):
    masks = [result["mask"] for result in two_rank_results]
    assert 0.3 < masks[0].float().mean() < 0.7
    assert not torch.equal(masks[0], masks[1])
    for result in two_rank_results:
        assert torch.equal(result["mask"], result["mask_again"])


def test_single_process_head_is_ordinary():
    torch.manual_seed(0)
    layers = alexnet_layers()
    head = layers[-1]
    assert isinstance(head, TensorParallelClassifier)
    assert type(head.dropout) is nn.Dropout
    logits = nn.Sequential(*layers)(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 10)


def test_world_size_one_linears_are_nn_linear():
    for parallel in (ColumnParallelLinear, RowParallelLinear):
        torch.manual_seed(3)
        reference = nn.Linear(6, 4)
        torch.manual_seed(3)
        layer = parallel(6, 4)
        assert torch.equal(layer.weight, reference.weight) and torch.equal(layer.bias, reference.bias)
        x = torch.randn(5, 6)
        assert torch.equal(layer(x), reference(x))


def test_invalid_sharding_is_rejected():
    with pytest.raises(ValueError, match="tp_group is required when tp_world_size = 2"):
        ColumnParallelLinear(4, 8, None, 0, 2)
    with pytest.raises(ValueError, match="out_features = 7 is not divisible by the tensor-parallel world size 2"):
        ColumnParallelLinear(4, 7, object(), 0, 2)
    with pytest.raises(ValueError, match="tensor-parallel rank 2 is invalid for world size 2"):
        RowParallelLinear(8, 4, object(), 2, 2)
    with pytest.raises(ValueError, match="channels must list the 5 convolution widths"):
        alexnet_layers(channels=(8, 8))


def test_tracker_dropout_leaves_the_default_generator_alone():
    seed_model_parallel_rng(11, tp_rank=0)
    before = torch.get_rng_state()
    first = TensorParallelDropout(0.5)(torch.ones(64))
    second = TensorParallelDropout(0.5)(torch.ones(64))
    assert torch.equal(torch.get_rng_state(), before)
    assert not torch.equal(first, second)  # the tracker's stream advanced
    seed_model_parallel_rng(11, tp_rank=0)
    assert torch.equal(TensorParallelDropout(0.5)(torch.ones(64)), first)
