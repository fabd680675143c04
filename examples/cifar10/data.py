"""CIFAR-10 input pipeline: torchvision's ``CIFAR10`` on a real dataset, or on a
generated dataset in the same on-disk format when no real one is available.

Real data: a torchvision root (the directory that holds ``cifar-10-batches-py``)
given as ``data_dir`` or in ``$CIFAR10_DATASET_PATH`` (the variable DeepSpeed's
tests read). It is loaded by ``torchvision.datasets.CIFAR10``, md5 checks included.

Generated data (these machines cannot download CIFAR-10): ``cifar-10-batches-py``
pickles with images that carry a learnable class signal (a fixed low-frequency
pattern per class plus pixel noise), generated deterministically from a seed
into a cache directory and loaded through the same torchvision code path by
:class:`GeneratedCIFAR10`, which checks the files against the md5 sums recorded
when they were written. It is not CIFAR-10: its classes are named
``generated_0`` .. ``generated_9`` and every description says "generated".
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torchvision.transforms as T
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import CIFAR10

from examples.sampling import GlobalBatchSampler

__all__ = [
    "CIFAR10_ENV",
    "CifarData",
    "GeneratedCIFAR10",
    "generate_cifar10_format",
    "generated_root",
    "load_cifar10",
    "micro_batches",
]

CIFAR10_ENV = "CIFAR10_DATASET_PATH"
MANIFEST = "generated_cifar10.json"
# Part of the generated dataset's directory name: bump it whenever the
# generator's output changes, so that stale caches are not reused.
GENERATOR_VERSION = 1
NUM_CLASSES = 10
_TRAIN_BATCHES = 5
_IMAGE_SHAPE = (3, 32, 32)
# Class signal: one pattern per class on a 4x4 grid of 8x8-pixel blocks.
_PATTERN_GRID = 4
_SIGNAL_AMPLITUDE = 64.0
_NOISE_STD = 32.0


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _images(rng: np.random.Generator, patterns: np.ndarray, labels: np.ndarray) -> np.ndarray:
    noise = rng.normal(0.0, _NOISE_STD, size=(len(labels), *_IMAGE_SHAPE))
    pixels = 128.0 + _SIGNAL_AMPLITUDE * patterns[labels] + noise
    # CIFAR-10 layout: one row of 3072 uint8 per image, channel-major (R, G, B planes).
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8).reshape(len(labels), -1)


def _write_batches(folder: Path, seed: int, per_batch: int, test_size: int) -> None:
    rng = np.random.default_rng(seed)
    block = _IMAGE_SHAPE[1] // _PATTERN_GRID
    coarse = rng.normal(size=(NUM_CLASSES, _IMAGE_SHAPE[0], _PATTERN_GRID, _PATTERN_GRID))
    patterns = np.kron(coarse, np.ones((block, block)))  # [classes, 3, 32, 32]
    splits = [(f"data_batch_{i}", per_batch) for i in range(1, _TRAIN_BATCHES + 1)]
    splits.append(("test_batch", test_size))
    for name, size in splits:
        labels = rng.integers(0, NUM_CLASSES, size=size)
        entry = {
            "batch_label": f"generated {name} (seed {seed})",
            "labels": labels.tolist(),
            "data": _images(rng, patterns, labels),
            "filenames": [f"generated_{name}_{i:05d}.png" for i in range(size)],
        }
        with open(folder / name, "wb") as handle:
            pickle.dump(entry, handle, protocol=pickle.HIGHEST_PROTOCOL)
    meta = {
        "label_names": [f"generated_{c}" for c in range(NUM_CLASSES)],
        "num_cases_per_batch": per_batch,
        "num_vis": int(np.prod(_IMAGE_SHAPE)),
    }
    with open(folder / "batches.meta", "wb") as handle:
        pickle.dump(meta, handle, protocol=pickle.HIGHEST_PROTOCOL)


def generated_root(cache_dir: str | os.PathLike, seed: int, train_size: int, test_size: int) -> Path:
    """Where :func:`generate_cifar10_format` puts the dataset for these arguments."""
    return Path(cache_dir) / f"generated-cifar10-v{GENERATOR_VERSION}-seed{seed}-train{train_size}-test{test_size}"


def generate_cifar10_format(cache_dir: str | os.PathLike, seed: int = 0, train_size: int = 10000,
                            test_size: int = 2000) -> Path:
    """Write a generated dataset in CIFAR-10's ``cifar-10-batches-py`` layout,
    unless it exists already; return its torchvision root.

    Deterministic in ``seed``. Safe to call from many processes at once: each
    writes a private directory and renames it into place; the first wins.
    """
    if train_size <= 0 or train_size % _TRAIN_BATCHES:
        raise ValueError(f"train_size = {train_size} must be a positive multiple of {_TRAIN_BATCHES} "
                         "(CIFAR-10 stores the training set as 5 batches)")
    if test_size <= 0:
        raise ValueError(f"test_size = {test_size} must be positive")
    root = generated_root(cache_dir, seed, train_size, test_size)
    if (root / MANIFEST).is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        folder = staging / CIFAR10.base_folder
        folder.mkdir()
        _write_batches(folder, seed, train_size // _TRAIN_BATCHES, test_size)
        manifest = {
            "description": "generated CIFAR-10-format data (not CIFAR-10): class patterns plus noise",
            "generator": __name__,
            "generator_version": GENERATOR_VERSION,
            "seed": seed,
            "train_size": train_size,
            "test_size": test_size,
            "md5": {p.name: _md5(p) for p in sorted(folder.iterdir())},
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        try:
            os.rename(staging, root)
        except OSError:
            if not (root / MANIFEST).is_file():  # not a lost race: a real failure
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return root


class GeneratedCIFAR10(CIFAR10):
    """torchvision's ``CIFAR10`` reading a dataset written by
    :func:`generate_cifar10_format`.

    The integrity check is torchvision's own, against the md5 sums recorded in
    the dataset's manifest (the real dataset's sums stay on ``CIFAR10``).
    """

    def __init__(self, root: str | os.PathLike, train: bool = True, transform=None, target_transform=None):
        manifest_path = Path(root) / MANIFEST
        if not manifest_path.is_file():
            raise FileNotFoundError(f"{manifest_path} not found: {root} is not a dataset written by "
                                    "generate_cifar10_format()")
        self.manifest = json.loads(manifest_path.read_text())
        md5 = self.manifest["md5"]
        self.train_list = [[f"data_batch_{i}", md5[f"data_batch_{i}"]] for i in range(1, _TRAIN_BATCHES + 1)]
        self.test_list = [["test_batch", md5["test_batch"]]]
        self.meta = {**CIFAR10.meta, "md5": md5[CIFAR10.meta["filename"]]}
        super().__init__(root, train=train, transform=transform, target_transform=target_transform,
                         download=False)


@dataclass(frozen=True)
class CifarData:
    """A loaded split and an honest description of where it came from."""

    dataset: Dataset
    description: str
    generated: bool

    @property
    def kind(self) -> str:
        """``"generated"`` or ``"CIFAR-10"``, for names and logs."""
        return "generated" if self.generated else "CIFAR-10"


def _transform() -> T.Compose:
    return T.Compose([T.ToTensor(), T.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])


def load_cifar10(data_dir: str | os.PathLike | None, cache_dir: str | os.PathLike, seed: int = 0,
                 train: bool = True, generated_train_size: int = 10000,
                 generated_test_size: int = 2000) -> CifarData:
    """The CIFAR-10 split to train or test on.

    ``data_dir`` (else ``$CIFAR10_DATASET_PATH``) must be a torchvision root
    holding the real ``cifar-10-batches-py``. When neither is given, a
    generated dataset (seeded by ``seed``) is created under ``cache_dir`` if
    needed and used instead.
    """
    data_dir = data_dir or os.environ.get(CIFAR10_ENV) or None
    split = "train" if train else "test"
    if data_dir is not None:
        folder = Path(data_dir) / CIFAR10.base_folder
        if not folder.is_dir():
            raise FileNotFoundError(f"CIFAR-10 not found: {folder} does not exist. Pass the directory "
                                    f"that contains {CIFAR10.base_folder}/ (torchvision's root) as "
                                    f"--data-dir or ${CIFAR10_ENV}, or neither to use generated data.")
        dataset = CIFAR10(data_dir, train=train, transform=_transform(), download=False)
        return CifarData(dataset, f"CIFAR-10 {split} ({len(dataset)} images) from {data_dir}", False)
    root = generate_cifar10_format(cache_dir, seed, generated_train_size, generated_test_size)
    dataset = GeneratedCIFAR10(root, train=train, transform=_transform())
    return CifarData(dataset, f"generated CIFAR-10-format {split} data, not CIFAR-10 "
                     f"({len(dataset)} images, seed {seed}) at {root}", True)


def micro_batches(dataset: Dataset, sampler: GlobalBatchSampler) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(images, labels)`` micro-batches in the sampler's order, as DeepSpeed's
    pipeline engine consumes them (``engine.train_batch(data_iter=...)``)."""
    for images, labels in DataLoader(dataset, batch_sampler=sampler, num_workers=0):
        yield images, labels
