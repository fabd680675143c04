"""A Hugging Face Llama checkpoint directory, loaded stage by stage.

``save_pretrained`` writes ``config.json`` and the weights as safetensors: one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``
(``weight_map``: parameter name -> file). A pipeline stage builds only its own
layers (:func:`examples.llama.model.llama_layer_specs`), and
:func:`load_local_weights` reads only their tensors, through
``safetensors.safe_open``, from only the files that hold them: a stage of a
large model never holds the whole checkpoint in memory.

Parameter names, by pipeline layer (``L`` decoder layers)::

    0        TokenEmbedding     model.embed_tokens.weight
    1        RotaryEmbedding    (nothing: its table follows from the config)
    2 + i    DecoderLayer i     model.layers.{i}.*
    2 + L    FinalNorm          model.norm.weight
    3 + L    head               lm_head.weight, or model.embed_tokens.weight when tied
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from transformers import LlamaConfig

from .model import EMBED_KEY, layer_index, prepare_config

__all__ = ["LoadedWeights", "checkpoint_files", "load_config", "load_local_weights", "local_parameter_names",
           "has_tokenizer", "TOKENIZER_FILES"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Any of these makes the directory's tokenizer the example's tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def load_config(directory: str | os.PathLike) -> LlamaConfig:
    """The checkpoint's ``config.json`` as a ``LlamaConfig``, prepared for the
    pipeline (:func:`examples.llama.model.prepare_config`).

    Raises:
        FileNotFoundError: no ``config.json`` in ``directory``.
        ValueError: the checkpoint is not a Llama model.
    """
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: --from-pretrained expects a directory written by "
                                "save_pretrained (config.json and safetensors weights)")
    model_type = json.loads(path.read_text()).get("model_type")
    if model_type != "llama":
        raise ValueError(f"{path} describes a {model_type!r} model; the Llama example loads only model_type "
                         "'llama'")
    return prepare_config(LlamaConfig.from_pretrained(directory))


def has_tokenizer(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a tokenizer (:data:`TOKENIZER_FILES`)."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def checkpoint_files(directory: str | os.PathLike) -> dict[str, Path]:
    """Parameter name -> the safetensors file that holds it.

    Raises:
        FileNotFoundError: neither ``model.safetensors.index.json`` nor
            ``model.safetensors`` is in ``directory`` (``.bin`` checkpoints are
            not read: save them again with ``safe_serialization=True``), or a
            file the index names is missing.
    """
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: directory / file for name, file in weight_map.items()}
        missing = sorted({str(path) for path in files.values() if not path.is_file()})
        if missing:
            raise FileNotFoundError(f"{index} lists shards that do not exist: {missing}")
        return files
    single = directory / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as handle:
            return {name: single for name in handle.keys()}
    present = sorted(path.name for path in directory.iterdir()) if directory.is_dir() else "no such directory"
    raise FileNotFoundError(f"{directory} has neither {INDEX_FILE} nor {SINGLE_FILE} (it holds: {present}); "
                            "the example reads safetensors checkpoints only: save the model again with "
                            "save_pretrained(..., safe_serialization=True)")


def _local_parts(module: nn.Module, config: LlamaConfig) -> list[tuple[nn.Module, str]]:
    """(module, checkpoint name prefix) of every layer this stage holds, each module once."""
    parts: list[tuple[nn.Module, str]] = []
    seen: set[int] = set()
    for index in range(module._local_start, module._local_stop):
        if index in (layer_index(config, "embed"), layer_index(config, "head")) and config.tie_word_embeddings:
            part, prefix = module.tied_modules[EMBED_KEY], "model.embed_tokens."
        elif index == layer_index(config, "embed"):
            part, prefix = getattr(module, str(index)), "model.embed_tokens."
        elif index == layer_index(config, "head"):
            part, prefix = getattr(module, str(index)).lm_head, "lm_head."
        elif index == layer_index(config, "norm"):
            part, prefix = getattr(module, str(index)).norm, "model.norm."
        elif index == layer_index(config, "rotary"):
            continue
        else:
            decoder = getattr(module, str(index))
            part, prefix = decoder.layer, f"model.layers.{decoder.index}."
        if id(part) not in seen:
            seen.add(id(part))
            parts.append((part, prefix))
    return parts


def local_parameter_names(module: nn.Module, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the tensor (parameter or saved buffer) of this stage
    that takes its value, for the layers of ``module`` (a built
    ``PipelineModule`` of :func:`examples.llama.model.llama_layer_specs`)."""
    return {prefix + name: tensor for part, prefix in _local_parts(module, config)
            for name, tensor in part.state_dict(keep_vars=True).items()}


@dataclass(frozen=True)
class LoadedWeights:
    """What :func:`load_local_weights` read: names, files opened, bytes."""

    names: tuple[str, ...]
    files: tuple[str, ...]
    bytes: int


def load_local_weights(module: nn.Module, config: LlamaConfig, directory: str | os.PathLike) -> LoadedWeights:
    """Copy this stage's tensors from the checkpoint in ``directory`` into
    ``module`` (converting dtypes), reading nothing else.

    Raises:
        KeyError: a tensor of this stage is not in the checkpoint (named).
        ValueError: a tensor's shape differs from the checkpoint's (named).
    """
    targets = local_parameter_names(module, config)
    files = checkpoint_files(directory)
    missing = sorted(name for name in targets if name not in files)
    if missing:
        raise KeyError(f"the checkpoint in {directory} lacks {missing} (stage layers "
                       f"{module._local_start}..{module._local_stop - 1}); is it the model its config.json describes?")
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in targets:
        by_file[files[name]].append(name)
    total = 0
    with torch.no_grad():
        for path, names in sorted(by_file.items()):
            with safe_open(path, framework="pt", device="cpu") as handle:
                for name in names:
                    source, target = handle.get_tensor(name), targets[name]
                    if source.shape != target.shape:
                        raise ValueError(f"{name} in {path} has shape {tuple(source.shape)}, the model's is "
                                         f"{tuple(target.shape)}")
                    target.copy_(source)
                    total += source.numel() * source.element_size()
    return LoadedWeights(tuple(sorted(targets)), tuple(str(path) for path in sorted(by_file)), total)
