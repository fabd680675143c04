"""The CIFAR-10 input pipeline: generated CIFAR-10-format data through
torchvision's loader, honest labelling, and the topology-independent order."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from torchvision.datasets import CIFAR10
from torchvision.transforms import PILToTensor

from examples.sampling import GlobalBatchSampler
from examples.cifar10.data import (CIFAR10_ENV, GeneratedCIFAR10, generate_cifar10_format,
                                   load_cifar10, micro_batches)

SIZES = {"train_size": 500, "test_size": 200}


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    return generate_cifar10_format(tmp_path_factory.mktemp("cache"), seed=3, **SIZES)


def _manifest(root):
    return json.loads((root / "generated_cifar10.json").read_text())


def test_generation_is_deterministic_and_seeded(generated, tmp_path):
    again = generate_cifar10_format(tmp_path / "a", seed=3, **SIZES)
    other = generate_cifar10_format(tmp_path / "b", seed=4, **SIZES)
    assert _manifest(again)["md5"] == _manifest(generated)["md5"]
    assert _manifest(other)["md5"]["data_batch_1"] != _manifest(generated)["md5"]["data_batch_1"]
    assert generate_cifar10_format(tmp_path / "a", seed=3, **SIZES) == again  # present: reused


def test_generated_data_loads_through_torchvision(generated):
    train = GeneratedCIFAR10(generated, train=True)
    test = GeneratedCIFAR10(generated, train=False)
    assert isinstance(train, CIFAR10)
    assert (len(train), len(test)) == (500, 200)
    assert train.data.shape == (500, 32, 32, 3) and train.data.dtype == np.uint8
    assert train.classes == [f"generated_{c}" for c in range(10)]
    assert set(train.targets) == set(range(10))


def test_real_cifar10_checksums_reject_generated_files(generated):
    with pytest.raises(RuntimeError, match="Dataset not found or corrupted"):
        CIFAR10(generated, train=True)


def test_corrupted_generated_file_is_rejected(generated, tmp_path):
    copy = generate_cifar10_format(tmp_path, seed=3, **SIZES)
    batch = copy / "cifar-10-batches-py" / "data_batch_2"
    data = bytearray(batch.read_bytes())
    data[-100] ^= 0xFF
    batch.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="Dataset not found or corrupted"):
        GeneratedCIFAR10(copy, train=True)


def test_class_signal_is_learnable(generated):
    """Nearest class mean, fitted on the training split, classifies the test split."""
    train, test = GeneratedCIFAR10(generated, train=True), GeneratedCIFAR10(generated, train=False)
    x_train, y_train = train.data.reshape(len(train), -1).astype(np.float64), np.array(train.targets)
    means = np.stack([x_train[y_train == c].mean(axis=0) for c in range(10)])
    x_test = test.data.reshape(len(test), -1).astype(np.float64)
    predicted = ((x_test[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    assert (predicted == np.array(test.targets)).mean() > 0.9


def test_load_without_data_dir_uses_generated_data_and_says_so(tmp_path, monkeypatch):
    monkeypatch.delenv(CIFAR10_ENV, raising=False)
    data = load_cifar10(None, tmp_path, seed=3, generated_train_size=500, generated_test_size=200)
    assert data.generated and data.kind == "generated"
    assert "not CIFAR-10" in data.description
    image, label = data.dataset[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert -1.0 <= image.min() and image.max() <= 1.0 and 0 <= label < 10


@pytest.mark.parametrize("via_env", [False, True], ids=["data-dir", "env"])
def test_missing_real_dataset_is_a_precise_error(tmp_path, monkeypatch, via_env):
    missing = tmp_path / "nowhere"
    monkeypatch.setenv(CIFAR10_ENV, str(missing)) if via_env else monkeypatch.delenv(CIFAR10_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match=r"nowhere/cifar-10-batches-py does not exist.*--data-dir"):
        load_cifar10(None if via_env else missing, tmp_path / "cache")


def _steps(dataset_size, micro, accum, dp, steps=7):
    """Per step, the samples of all data-parallel ranks, rank by rank."""
    per_rank = [list(GlobalBatchSampler(dataset_size, micro, accum, dp, rank, steps, seed=5))
                for rank in range(dp)]
    return [[i for rank in range(dp) for mb in per_rank[rank][s * accum:(s + 1) * accum] for i in mb]
            for s in range(steps)]


def test_every_layout_with_the_same_global_batch_sees_the_same_samples():
    reference = _steps(50, micro=12, accum=1, dp=1)
    for micro, accum, dp in [(6, 2, 1), (3, 1, 4), (2, 3, 2), (1, 12, 1)]:
        assert _steps(50, micro, accum, dp) == reference, (micro, accum, dp)


def test_each_epoch_is_a_permutation():
    stream = [i for step in _steps(50, micro=10, accum=1, dp=1, steps=10) for i in step]
    for epoch in range(2):
        assert sorted(stream[epoch * 50:(epoch + 1) * 50]) == list(range(50))
    assert stream[:50] != stream[50:]
    assert Counter(stream) == Counter({i: 2 for i in range(50)})


def test_micro_batches_follow_the_sampler(generated):
    dataset = GeneratedCIFAR10(generated, transform=PILToTensor())
    sampler = GlobalBatchSampler(len(dataset), 4, 2, 2, 1, steps=2)
    batches = list(micro_batches(dataset, sampler))
    assert len(batches) == len(sampler) == 4
    expected = [dataset.targets[i] for i in list(sampler)[1]]
    assert batches[1][1].tolist() == expected


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"dp_rank = 2 is not in \[0, dp_size = 2\)"):
        GlobalBatchSampler(10, 2, 1, 2, 2, 1)
    with pytest.raises(ValueError, match="micro_batch = 0 must be positive"):
        GlobalBatchSampler(10, 0, 1, 1, 0, 1)
