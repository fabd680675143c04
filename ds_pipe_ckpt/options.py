"""The options of one checkpoint call: torch's checkpoint keywords and ours,
resolved against the configuration in force and checked.

``ds_pipe_ckpt.checkpoint`` takes torch's keywords with torch's meaning
(``use_reentrant``, ``preserve_rng_state``, ``context_fn``,
``determinism_check``, ``debug``, ``early_stop``,
``respect_saved_tensors_hooks``), so that callers written for
``torch.utils.checkpoint`` (transformers passes its users'
``gradient_checkpointing_kwargs`` through) work unchanged, plus ``verify``.
``None`` follows the configuration. A keyword that the chosen mode cannot
honour is a :class:`~ds_pipe_ckpt.ConfigError` naming it, as torch raises for
``context_fn`` and ``debug`` with ``use_reentrant=True``; like torch, the
reentrant mode accepts ``early_stop`` and ``determinism_check`` and has no
use for them (its recomputation always runs to the end; see
:mod:`ds_pipe_ckpt.checkpoint` for the check it gets instead).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch.utils.checkpoint as torch_checkpoint

from .config import CheckpointingConfig
from .errors import ConfigError
from .recompute import torch_determinism_check
from .selective import ops_to_keep, selective_context_fn

__all__ = ["CheckpointOptions", "DETERMINISM_CHECKS"]

DETERMINISM_CHECKS = ("default", "none")


def _flag(key: str, value: Any, configured: bool) -> bool:
    if value is None:
        return configured
    if not isinstance(value, bool):
        raise ConfigError(key, value, "True, False or None (None follows configure())")
    return value


@dataclass(frozen=True)
class CheckpointOptions:
    """How one region is checkpointed.

    ``context_fn`` is torch's (a callable returning the forward and the
    recomputation context managers) or None; ``selective`` asks for
    :mod:`ds_pipe_ckpt.selective`'s, built from ``save_ops``.
    """

    use_reentrant: bool
    preserve_rng_state: bool = True
    early_stop: bool = True
    determinism_check: str = "default"
    debug: bool = False
    verify: bool = False
    context_fn: Callable[[], tuple] | None = None
    respect_saved_tensors_hooks: bool | None = None
    selective: bool = False
    save_ops: tuple[str, ...] | None = None

    @classmethod
    def resolve(cls, config: CheckpointingConfig, *, use_reentrant: Any = None, preserve_rng_state: Any = None,
                early_stop: Any = None, determinism_check: Any = None, debug: Any = None, verify: Any = None,
                context_fn: Any = None, respect_saved_tensors_hooks: Any = None,
                policy: str | None = None) -> "CheckpointOptions":
        """Keyword arguments of a call (``None``: as configured) over ``config``.

        ``policy`` (``"full"`` or ``"selective"``) overrides
        ``activation_checkpointing.policy`` for this region (the planner's choice).
        """
        reentrant = _flag("use_reentrant", use_reentrant, config.use_reentrant)
        if determinism_check is None:
            determinism_check = "default"
        if determinism_check not in DETERMINISM_CHECKS:
            raise ConfigError("determinism_check", determinism_check, " or ".join(map(repr, DETERMINISM_CHECKS)))
        if context_fn is not None and not callable(context_fn):
            raise ConfigError("context_fn", context_fn, "a callable returning two context managers, or None")
        if respect_saved_tensors_hooks is not None and not isinstance(respect_saved_tensors_hooks, bool):
            raise ConfigError("respect_saved_tensors_hooks", respect_saved_tensors_hooks, "True, False or None")
        policy = config.policy if policy is None else policy
        options = cls(use_reentrant=reentrant,
                      preserve_rng_state=_flag("preserve_rng_state", preserve_rng_state, True),
                      early_stop=_flag("early_stop", early_stop, config.early_stop),
                      determinism_check=determinism_check,
                      debug=_flag("debug", debug, config.debug),
                      verify=_flag("verify", verify, config.verify_recompute),
                      context_fn=context_fn,
                      respect_saved_tensors_hooks=respect_saved_tensors_hooks,
                      selective=policy == "selective",
                      save_ops=config.save_ops)
        options._check()
        return options

    def _check(self) -> None:
        if self.use_reentrant:
            refused = {"debug": self.debug, "verify": self.verify, "context_fn": self.context_fn,
                       "respect_saved_tensors_hooks": self.respect_saved_tensors_hooks,
                       "activation_checkpointing.policy": "selective" if self.selective else None}
            for key, value in refused.items():
                if value not in (None, False):
                    raise ConfigError(key, value, "unset with use_reentrant=True",
                                      f"{key} needs torch's non-reentrant checkpoint: pass use_reentrant=False "
                                      "(or set pipeline.use_reentrant to false).")
            if not self.preserve_rng_state:
                raise ConfigError("preserve_rng_state", False, "True with use_reentrant=True",
                                  "DeepSpeed's reentrant checkpoint always restores the RNG states (also the "
                                  "model-parallel tracker's) for the recomputation; preserve_rng_state=False "
                                  "is honoured with use_reentrant=False.")
            return
        if self.selective and self.context_fn is not None:
            raise ConfigError("context_fn", self.context_fn, "None when activation_checkpointing.policy is "
                              "\"selective\"", "Selective checkpointing supplies its own context_fn; pass "
                              "yours with policy \"full\", or set save_ops to choose what is kept.")
        if self.debug and (self.context_fn is not None or self.selective):
            raise ConfigError("debug", True, "False with a context_fn or the selective policy",
                              "torch's debug mode installs its own context_fn.")

    @functools.cached_property
    def torch_keywords(self) -> dict[str, Any]:
        """The keyword arguments of ``torch.utils.checkpoint.checkpoint`` for
        these options (computed once: every non-reentrant call passes them).
        Those equal to the installed torch's own defaults are left out: each
        wrapper around torch's checkpoint passes its keywords on again."""
        if self.selective:
            context_fn = selective_context_fn(ops_to_keep(self.save_ops))
        else:
            context_fn = self.context_fn if self.context_fn is not None else torch_checkpoint.noop_context_fn
        determinism_check = torch_determinism_check(self.determinism_check, torch_contexts=self.context_fn is None)
        keywords = {"use_reentrant": False, "preserve_rng_state": self.preserve_rng_state, "context_fn": context_fn,
                    "determinism_check": determinism_check, "debug": self.debug,
                    # verify compares every op of the recomputation: it must run to the end.
                    "early_stop": self.early_stop and not self.verify}
        if self.respect_saved_tensors_hooks is not None:
            keywords["respect_saved_tensors_hooks"] = self.respect_saved_tensors_hooks
        defaults = {name: parameter.default
                    for name, parameter in inspect.signature(torch_checkpoint.checkpoint).parameters.items()}
        return {name: value for name, value in keywords.items()
                if not (type(value) is type(defaults.get(name)) and value == defaults[name])}

    def learning(self) -> "CheckpointOptions":
        """The options of a reentrant-mode region's first call, which runs
        non-reentrantly (see :mod:`ds_pipe_ckpt.checkpoint`)."""
        return replace(self, use_reentrant=False, early_stop=True)
