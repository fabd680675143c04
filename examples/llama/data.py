"""The Llama example's tokens: the GPT example's corpus (Python standard-library
sources, :mod:`examples.gpt.data`), as bytes, or through a checkpoint's own
tokenizer.

Without a tokenizer a token is a byte (ids 0..255: the model's vocabulary must
hold at least 256). With one, each file of the corpus (the text between NUL
separators) is tokenised on its own, without special tokens, and the files are
joined with the tokenizer's end-of-sequence id when it has one. The tokens are
cached (int32 ``.npy`` plus a JSON manifest) under a name that carries the
SHA-256 of the byte corpus and of the tokenizer's files, and checked on load.

Windows, order and micro-batches are the GPT example's
(:func:`examples.gpt.data.micro_batches`, :class:`examples.sampling.GlobalBatchSampler`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from examples.gpt.data import SEPARATOR, Corpus, load_corpus

__all__ = ["TokenizedCorpus", "load_tokens", "tokenizer_digest"]

# Part of the cache file name: bump it whenever the tokenisation recipe changes.
TOKENS_VERSION = 1


@dataclass(frozen=True)
class TokenizedCorpus(Corpus):
    """The corpus through a tokenizer; ``manifest`` adds ``tokenizer`` (its
    directory) and ``tokenizer_sha256``."""

    @property
    def description(self) -> str:
        return (f"the GPT example's standard-library corpus through the tokenizer of {self.manifest['tokenizer']}: "
                f"{self.manifest['tokens']} tokens, sha256 {self.manifest['sha256'][:12]} at {self.path}")


def tokenizer_digest(directory: str | os.PathLike) -> str:
    """SHA-256 over the names and bytes of the tokenizer files in ``directory``
    (``tokenizer*``, ``special_tokens_map.json``, ``*.model``)."""
    digest = hashlib.sha256()
    for path in sorted(Path(directory).iterdir()):
        if path.is_file() and (path.name.startswith("tokenizer") or path.name == "special_tokens_map.json"
                               or path.suffix == ".model"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _tokenize(corpus: Corpus, tokenizer_dir: Path) -> np.ndarray:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    documents = bytes(corpus.tokens.numpy()).split(SEPARATOR)
    separator = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    ids: list[int] = []
    for document in documents:
        if document:
            ids += tokenizer(document.decode("utf-8"), add_special_tokens=False)["input_ids"] + separator
    if max(ids) >= 2**31:
        raise ValueError(f"token id {max(ids)} of {tokenizer_dir} does not fit in int32")
    return np.asarray(ids, dtype=np.int32)


def load_tokens(cache_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None) -> Corpus:
    """The byte corpus (``tokenizer_dir`` None) or its tokens under the
    tokenizer in ``tokenizer_dir``, built and cached on first use.

    Raises:
        ValueError: a cached token file does not match its manifest (delete
            both files named in the message to rebuild them).
    """
    corpus = load_corpus(cache_dir)
    if tokenizer_dir is None:
        return corpus
    tokenizer_dir = Path(tokenizer_dir)
    tokenizer_sha = tokenizer_digest(tokenizer_dir)
    path = Path(cache_dir) / (f"tokens-v{TOKENS_VERSION}-{corpus.manifest['sha256'][:16]}-"
                              f"{tokenizer_sha[:16]}.npy")
    manifest_path = path.with_suffix(".json")
    if not (path.is_file() and manifest_path.is_file()):
        array = _tokenize(corpus, tokenizer_dir)
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        with open(staging, "wb") as handle:
            np.save(handle, array)
        manifest = {"description": "tokens of the GPT example's byte corpus", "tokens_version": TOKENS_VERSION,
                    "python": corpus.manifest["python"], "corpus_sha256": corpus.manifest["sha256"],
                    "tokenizer": str(tokenizer_dir), "tokenizer_sha256": tokenizer_sha, "tokens": int(array.size),
                    "sha256": hashlib.sha256(array.tobytes()).hexdigest()}
        manifest_staging = manifest_path.with_name(f".{manifest_path.name}.{os.getpid()}")
        manifest_staging.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(staging, path)
        os.replace(manifest_staging, manifest_path)
    manifest = json.loads(manifest_path.read_text())
    array = np.load(path)
    digest = hashlib.sha256(array.tobytes()).hexdigest()
    if array.dtype != np.int32 or digest != manifest["sha256"]:
        raise ValueError(f"{path} does not match {manifest_path} (dtype {array.dtype}, sha256 {digest[:12]} vs "
                         f"{manifest['sha256'][:12]}); delete both files to rebuild the tokens")
    return TokenizedCorpus(torch.from_numpy(array), manifest, path)
