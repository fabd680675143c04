"""Byte-level text from Python's standard library, and the order it is trained in.

The corpus is the concatenation, in the order of :data:`STDLIB_FILES`, of a
fixed list of source files of the running Python's standard library
(``sysconfig.get_paths()["stdlib"]``), each followed by a NUL byte; a token is
a byte (vocabulary 256). Every machine with the same Python version has the
same corpus, without a download: the list names only top-level modules present
in CPython 3.10 to 3.14 (nothing machine-specific such as
``_sysconfigdata_*.py`` or ``sitecustomize.py``), and a file missing from an
installation is an error, not a silently smaller corpus. The SHA-256 of the
corpus is in its manifest and in every description, so two machines can check
that they trained on the same bytes.

It is written once as a uint8 ``.npy`` file (plus a JSON manifest) under a cache
directory and loaded from there.

Order: the corpus is cut into windows of ``context + 1`` tokens, window ``w``
starting at token ``w * context`` (input = its first ``context`` tokens, target =
its last ``context``). Step ``s`` trains on windows ``[G s, G s + G)`` of a
seeded per-epoch permutation of all windows, ``G`` the global batch, whatever
the topology: data-parallel rank ``d`` takes the ``d``-th contiguous share and
splits it into micro-batches (:class:`examples.sampling.GlobalBatchSampler`).

Variable lengths (:func:`variable_micro_batches`): the same windows and order,
but window ``w`` is cut to its own length ``L_w`` (:func:`window_lengths`,
seeded, between a quarter of ``context`` and ``context``): input = its first
``L_w`` tokens, target = the next ``L_w``. Each micro-batch is padded on the
right to its own longest sample, inputs with :data:`PAD_TOKEN`, targets with
:data:`IGNORE_INDEX` (which both examples' losses ignore). The models attend
causally, so a padded position changes no loss of a real one.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from examples.sampling import GlobalBatchSampler

__all__ = [
    "STDLIB_FILES",
    "Corpus",
    "IGNORE_INDEX",
    "PAD_TOKEN",
    "build_corpus",
    "first_micro_batch",
    "corpus_path",
    "load_corpus",
    "micro_batches",
    "stdlib_dir",
    "variable_micro_batches",
    "window_lengths",
]

# Sorted; top-level modules of CPython's Lib/ that exist from 3.10 to 3.14 (not
# turned into packages, not removed by PEP 594), plus the licence text. About
# 2.7 MB on Python 3.11.
STDLIB_FILES = (
    "LICENSE.txt",
    "_pydecimal.py",
    "_pyio.py",
    "abc.py",
    "argparse.py",
    "ast.py",
    "base64.py",
    "bisect.py",
    "calendar.py",
    "codecs.py",
    "configparser.py",
    "contextlib.py",
    "copy.py",
    "csv.py",
    "dataclasses.py",
    "datetime.py",
    "difflib.py",
    "dis.py",
    "doctest.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "gettext.py",
    "heapq.py",
    "inspect.py",
    "ipaddress.py",
    "locale.py",
    "mailbox.py",
    "numbers.py",
    "optparse.py",
    "pickle.py",
    "platform.py",
    "pprint.py",
    "pydoc.py",
    "queue.py",
    "random.py",
    "shlex.py",
    "shutil.py",
    "socket.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tarfile.py",
    "tempfile.py",
    "textwrap.py",
    "threading.py",
    "tokenize.py",
    "traceback.py",
    "types.py",
    "typing.py",
    "uuid.py",
    "warnings.py",
    "weakref.py",
)
# Between files.
SEPARATOR = b"\x00"
# Part of the cache file name: bump it whenever the corpus recipe changes.
CORPUS_VERSION = 1
MANIFEST_SUFFIX = ".json"
# Variable lengths: what pads a micro-batch's shorter samples (inputs: the NUL file
# separator; targets: the index cross-entropy ignores).
PAD_TOKEN = 0
IGNORE_INDEX = -100


def stdlib_dir() -> Path:
    """The running Python's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_path(cache_dir: str | os.PathLike) -> Path:
    """Where :func:`build_corpus` caches the corpus of the running Python."""
    version = platform.python_version()
    return Path(cache_dir) / f"stdlib-v{CORPUS_VERSION}-{platform.python_implementation().lower()}{version}.npy"


def _read_sources(source_dir: Path) -> tuple[bytes, list[dict]]:
    missing = [name for name in STDLIB_FILES if not (source_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the GPT corpus needs {len(STDLIB_FILES)} standard-library files, but {missing} are missing "
            f"from {source_dir} (Python {platform.python_version()}). Use a complete CPython installation, "
            "or edit examples/gpt/data.py STDLIB_FILES (and bump CORPUS_VERSION).")
    parts, files = [], []
    for name in STDLIB_FILES:
        data = (source_dir / name).read_bytes()
        parts += [data, SEPARATOR]
        files.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return b"".join(parts), files


def _write_atomically(path: Path, write) -> None:
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        write(Path(staging))
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)


def _save_array(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as handle:  # a file object: np.save would append ".npy" to a bare name
        np.save(handle, array)


def build_corpus(cache_dir: str | os.PathLike, source_dir: str | os.PathLike | None = None) -> Path:
    """Write the corpus of :data:`STDLIB_FILES` (from ``source_dir``, default
    :func:`stdlib_dir`) to :func:`corpus_path` unless it is there already;
    return that path.

    Safe to call from many processes at once: files are written under private
    names and renamed into place.
    """
    path = corpus_path(cache_dir)
    manifest_path = path.with_suffix(MANIFEST_SUFFIX)
    if path.is_file() and manifest_path.is_file():
        return path
    source_dir = Path(source_dir) if source_dir is not None else stdlib_dir()
    text, files = _read_sources(source_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    manifest = {
        "description": "byte-level tokens of Python standard-library sources, NUL-separated",
        "corpus_version": CORPUS_VERSION,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "source_dir": str(source_dir),
        "tokens": len(text),
        "sha256": hashlib.sha256(text).hexdigest(),
        "files": files,
    }
    _write_atomically(path, lambda staging: _save_array(staging, np.frombuffer(text, dtype=np.uint8)))
    _write_atomically(manifest_path, lambda staging: staging.write_text(json.dumps(manifest, indent=1) + "\n"))
    return path


@dataclass(frozen=True)
class Corpus:
    """The tokens (uint8, one per byte) and what they are."""

    tokens: torch.Tensor
    manifest: dict
    path: Path

    @property
    def description(self) -> str:
        """For logs and summaries."""
        return (f"{len(STDLIB_FILES)} files of the {self.manifest['python']} standard library, "
                f"{self.manifest['tokens']} byte tokens, sha256 {self.manifest['sha256'][:12]} at {self.path}")

    def num_windows(self, context: int) -> int:
        """Windows of ``context + 1`` tokens starting every ``context`` tokens."""
        return (len(self.tokens) - 1) // context


def load_corpus(cache_dir: str | os.PathLike, source_dir: str | os.PathLike | None = None) -> Corpus:
    """Build the corpus if needed, then load it and check it
    against its manifest's SHA-256.

    Raises:
        ValueError: the cached file does not match its manifest (delete both
            files named in the message to rebuild them).
    """
    path = build_corpus(cache_dir, source_dir)
    manifest_path = path.with_suffix(MANIFEST_SUFFIX)
    manifest = json.loads(manifest_path.read_text())
    array = np.load(path)
    digest = hashlib.sha256(array.tobytes()).hexdigest()
    if array.dtype != np.uint8 or digest != manifest["sha256"]:
        raise ValueError(f"{path} does not match {manifest_path} (dtype {array.dtype}, sha256 {digest[:12]} vs "
                         f"{manifest['sha256'][:12]}); delete both files to rebuild the corpus")
    return Corpus(torch.from_numpy(array), manifest, path)


def micro_batches(corpus: Corpus, batches: Sequence[list[int]] | Sampler[list[int]],
                  context: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(inputs, targets)`` micro-batches, both ``[B, context]`` int64, for the
    window indices of each element of ``batches``, as DeepSpeed's pipeline
    engine consumes them (``engine.train_batch(data_iter=...)``)."""
    span = torch.arange(context + 1)
    for indices in batches:
        windows = corpus.tokens[torch.tensor(indices)[:, None] * context + span].long()
        yield windows[:, :-1], windows[:, 1:]


def window_lengths(num_windows: int, context: int, seed: int = 0) -> torch.Tensor:
    """Each window's own length (int64 ``[num_windows]``), uniform in
    ``[max(1, context // 4), context]``, drawn from a generator seeded with
    ``seed`` (the same for every layout and config)."""
    generator = torch.Generator().manual_seed(seed * 100_003 + 1)
    return torch.randint(max(1, context // 4), context + 1, (num_windows,), generator=generator)


def variable_micro_batches(corpus: Corpus, batches: Sequence[list[int]] | Sampler[list[int]], context: int,
                           lengths: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Like :func:`micro_batches`, but window ``w`` is ``lengths[w]`` tokens
    long: ``(inputs, targets)``, both ``[B, longest of the micro-batch]`` int64,
    padded on the right with :data:`PAD_TOKEN` and :data:`IGNORE_INDEX`."""
    for indices in batches:
        sizes = lengths[torch.tensor(indices)].tolist()
        inputs = torch.full((len(indices), max(sizes)), PAD_TOKEN, dtype=torch.long)
        targets = torch.full_like(inputs, IGNORE_INDEX)
        for row, (window, size) in enumerate(zip(indices, sizes)):
            tokens = corpus.tokens[window * context:window * context + size + 1].long()
            inputs[row, :size], targets[row, :size] = tokens[:-1], tokens[1:]
        yield inputs, targets


def first_micro_batch(corpus: Corpus, config: dict, context: int,
                      seed: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The first ``(inputs, labels)`` micro-batch of the DeepSpeed ``config``'s
    size, as the first data-parallel rank draws it (a planned partition
    profiles the layers and the loss on it), or ``(None, None)`` when the
    config gives no ``train_micro_batch_size_per_gpu``."""
    micro = config.get("train_micro_batch_size_per_gpu")
    if micro is None:
        return None, None
    sampler = GlobalBatchSampler(corpus.num_windows(context), micro, 1, 1, 0, 1, seed=seed)
    return next(micro_batches(corpus, sampler, context))
