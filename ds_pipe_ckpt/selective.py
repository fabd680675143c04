"""Selective (op-level) checkpointing: keep the outputs of the expensive ops
of a checkpointed region and recompute only the cheap ones.

Built on torch's own selective activation checkpointing
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``): during the
forward the outputs of the ops in the save set are kept; the recomputation
takes them from there instead of running those ops again, and runs every other
op (norms, activations, dropout with the replayed RNG, elementwise ops). The
gradients are the same as without checkpointing, bit for bit: the kept
outputs are the forward's own.

The default save set is what dominates a transformer or a CNN's compute and
costs least memory per FLOP to keep: matrix multiplications, convolutions and
the fused attention kernels (torchtitan's "selective op" policy and Megatron's
selective recomputation make the same trade). ``activation_checkpointing.save_ops``
replaces it with a list of ATen op names.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .errors import ConfigError

__all__ = ["DEFAULT_SAVE_OPS", "resolve_ops", "ops_to_keep", "selective_context_fn"]

# ATen op names (overload packets: every overload is kept). Those this torch
# build does not have (e.g. cuDNN attention on a CPU-only build) are skipped.
DEFAULT_SAVE_OPS = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "aten.convolution",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_fused_attention_overrideable",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
)

KEY = "activation_checkpointing.save_ops"


def _lookup(name: str) -> list[torch._ops.OpOverload] | None:
    """The overloads ``name`` ("aten.mm" or "aten.mm.default") stands for, or None."""
    parts = name.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        return None
    namespace = getattr(torch.ops, parts[0], None)
    packet = getattr(namespace, parts[1], None) if namespace is not None else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    if len(parts) == 2:
        return [getattr(packet, overload) for overload in packet.overloads()]
    overload = getattr(packet, parts[2], None)
    return [overload] if isinstance(overload, torch._ops.OpOverload) else None


def resolve_ops(names: Iterable[str], *, key: str = KEY, skip_missing: bool = False) -> tuple[torch._ops.OpOverload, ...]:
    """The op overloads named by ``names``; a name that is no op is a :class:`ConfigError`
    (or skipped with ``skip_missing``, for the default set)."""
    ops: list[torch._ops.OpOverload] = []
    for name in names:
        found = _lookup(name) if isinstance(name, str) else None
        if found is None:
            if skip_missing:
                continue
            raise ConfigError(key, name, "ATen op names such as \"aten.mm\" (every overload) or "
                              "\"aten.mm.default\" (one overload)",
                              "Names are those of torch.ops: print(torch.ops.aten.mm.overloads()) lists an "
                              "op's overloads.")
        ops.extend(op for op in found if op not in ops)
    return tuple(ops)


@functools.lru_cache(maxsize=32)
def ops_to_keep(save_ops: tuple[str, ...] | None) -> tuple[torch._ops.OpOverload, ...]:
    """The ops whose outputs selective checkpointing keeps: ``save_ops``
    (``activation_checkpointing.save_ops``) resolved, or, for None,
    :data:`DEFAULT_SAVE_OPS` as far as this torch build has them."""
    if save_ops is None:
        return resolve_ops(DEFAULT_SAVE_OPS, skip_missing=True)
    return resolve_ops(save_ops)


class _KeepOutputsOf:
    """torch's selective-checkpoint policy: keep the outputs of ``ops``, recompute
    every other op. Called for every op of the region's forward: a set lookup."""

    def __init__(self, ops: tuple[torch._ops.OpOverload, ...]):
        self.ops = frozenset(ops)

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in self.ops else CheckpointPolicy.PREFER_RECOMPUTE


@functools.lru_cache(maxsize=32)
def selective_context_fn(ops: tuple[torch._ops.OpOverload, ...]) -> Callable[[], tuple]:
    """A ``context_fn`` for torch's checkpoint that keeps the outputs of ``ops``."""
    return functools.partial(create_selective_checkpoint_contexts, _KeepOutputsOf(ops))
