"""The CIFAR-10 example's ResNet (BatchNorm, in-place ReLUs, residual adds) and
how train.py picks a model and evaluates, in one process; the 3D convergence
test (test_cifar10_convergence.py) trains it in every topology."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from examples.cifar10.model import RESNET_WIDTHS, BasicBlock, resnet_layers
from examples.cifar10.train import EvalData, config_model, parse_args

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "examples" / "cifar10" / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.json"))


def _resnet(seed: int = 0, **kwargs) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*resnet_layers(10, **kwargs))


def test_layers_stem_blocks_head():
    layers = resnet_layers(10, widths=(8, 16, 32), blocks=1)
    kinds = [type(layer).__name__ for layer in layers]
    assert kinds == ["Conv2d", "BatchNorm2d", "ReLU", "BasicBlock", "BasicBlock", "BasicBlock",
                     "AdaptiveAvgPool2d", "Flatten", "TensorParallelClassifier"]
    assert layers[2].inplace  # an in-place ReLU as a layer of its own
    first, second, third = layers[3:6]
    assert first.downsample is None and first.relu.inplace  # identity shortcut
    assert isinstance(second.downsample[0], nn.Conv2d) and second.downsample[0].stride == (2, 2)
    assert isinstance(second.downsample[1], nn.BatchNorm2d)
    assert sum(isinstance(m, nn.BatchNorm2d) for layer in layers for m in layer.modules()) == 1 + 2 + 3 + 3
    assert all(conv.bias is None for layer in layers for conv in layer.modules() if isinstance(conv, nn.Conv2d))
    assert len(resnet_layers(10, blocks=3)) == 3 + 3 * len(RESNET_WIDTHS) + 3  # ResNet-20's blocks


def test_forward_shapes_and_training_updates_statistics():
    model = _resnet(widths=(8, 16))
    images = torch.randn(4, 3, 32, 32)
    out = model(images)
    assert out.shape == (4, 10)
    out.sum().backward()
    bn = model[1]
    assert bn.num_batches_tracked.item() == 1
    assert not torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))
    model.eval()
    statistics = {name: b.clone() for name, b in model.named_buffers()}
    with torch.no_grad():
        model(images)
    assert all(torch.equal(statistics[name], b) for name, b in model.named_buffers())


def test_same_seed_same_model():
    first, second, other = _resnet(3, widths=(8, 16)), _resnet(3, widths=(8, 16)), _resnet(4, widths=(8, 16))
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert not all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), other.state_dict().values()))


def test_basic_block_residual():
    torch.manual_seed(0)
    block = BasicBlock(4, 4).eval()
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        branch = block.bn2(block.conv2(torch.relu(block.bn1(block.conv1(x)))))
        assert torch.equal(block(x.clone()), torch.relu(branch + x))


@pytest.mark.parametrize("kwargs", [dict(widths=()), dict(widths=(8, 0)), dict(blocks=0), dict(widths=(8,) * 7)])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        resnet_layers(10, **kwargs)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_deepspeed_accepts_every_config_as_is(path):
    """DeepSpeed's own config parser takes the files unchanged (it ignores
    top-level keys it does not know, such as this example's "cifar10")."""
    from deepspeed.runtime.config import DeepSpeedConfig

    config = DeepSpeedConfig(str(path))
    assert config.train_batch_size == 32
    assert config.train_micro_batch_size_per_gpu == 8


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_names_its_model(path):
    config = json.loads(path.read_text())
    expected = "resnet" if path.stem.startswith("resnet_") else "alexnet"
    assert config_model(str(path), config, None) == expected
    assert config_model(str(path), config, expected) == expected
    if expected == "alexnet":
        assert config_model(str(path), config, "resnet") == "resnet"  # --model picks it
    else:
        with pytest.raises(ValueError, match="names the model 'resnet'"):
            config_model(str(path), config, "alexnet")


@pytest.mark.parametrize("section", [{"model": "vgg"}, {"modle": "resnet"}, "resnet"])
def test_bad_config_section(section):
    with pytest.raises(ValueError, match="cifar10"):
        config_model("x.json", {"cifar10": section}, None)


def test_parse_args_resolves_models_per_config():
    args = parse_args(["--deepspeed_config", str(CONFIG_DIR / "none.json"), str(CONFIG_DIR / "resnet_none.json"),
                       "--steps", "100", "--resnet-steps", "25", "--widths", "8", "16"])
    assert args.models == ["alexnet", "resnet"]
    assert (args.steps, args.resnet_steps, args.widths) == (100, 25, [8, 16])
    assert parse_args(["--model", "resnet", "--deepspeed_config", str(CONFIG_DIR / "none.json")]).models == ["resnet"]
    with pytest.raises(SystemExit):
        parse_args(["--model", "alexnet", "--deepspeed_config", str(CONFIG_DIR / "resnet_none.json")])


class _Items(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((3, 2, 2), float(i)), i % 10


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_eval_data_covers_every_image_once_in_every_layout(dp):
    from examples.cifar10.data import CifarData

    data = EvalData(CifarData(_Items(50), "items", True), 45)
    seen, padded = [], 0
    for rank in range(dp):
        batches = data.micro_batches(8, dp, rank)
        assert len(batches) == -(-45 // (8 * dp))  # every rank runs the same number of micro-batches
        for images, labels in batches:
            assert images.shape == (8, 3, 2, 2)
            real = labels != -100
            seen += images[real, 0, 0, 0].long().tolist()
            padded += int((~real).sum())
            assert torch.equal(images[~real], torch.zeros_like(images[~real]))
    assert sorted(seen) == list(range(45))
    assert padded == len(batches) * 8 * dp - 45

