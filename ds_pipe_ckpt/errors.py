"""Exceptions raised by ds_pipe_ckpt.

Every error names what was wrong (the configuration key, the layer, the value)
and says how to fix it.
"""

from torch.utils.checkpoint import CheckpointError

__all__ = ["ConfigError", "RecomputeMismatchError", "InPlaceInputError", "ReentrantFallbackWarning",
           "UpstreamLimitError"]


class ConfigError(ValueError, AssertionError):
    """A configuration value (JSON key or keyword argument) is invalid.

    The message names the key, the value received and what is allowed. Also an
    ``AssertionError``: where upstream DeepSpeed checks the same thing with an
    ``assert``, code written against upstream (``except AssertionError``,
    ``pytest.raises(AssertionError, match=...)``) catches ours too, and the
    message ends with upstream's words (``upstream``).
    """

    def __init__(self, key: str, value, allowed: str, hint: str = "", *, upstream: str = ""):
        self.key = key
        self.value = value
        self.allowed = allowed
        self.hint = hint
        message = f"{key} = {value!r} is invalid: expected {allowed}."
        if hint:
            message += f" {hint}"
        if upstream:
            message += f" (DeepSpeed: {upstream})"
        super().__init__(message)


class RecomputeMismatchError(CheckpointError):
    """A checkpointed region saved different tensors when it was recomputed.

    Subclass of :class:`torch.utils.checkpoint.CheckpointError`, so code that
    already catches torch's error keeps working. The message names the region
    (pipeline layers or the checkpointed function) and the micro-batch.
    """


class InPlaceInputError(RuntimeError):
    """A checkpointed region's saved input was modified in place (by the region
    itself, or by later code before the region was recomputed), so the
    recomputation would not start from the values the forward saw."""


class ReentrantFallbackWarning(UserWarning):
    """Reentrant checkpointing was asked for a call whose tensor inputs do not
    require grad; the call used the non-reentrant checkpoint so that the
    parameters inside it still get their gradients."""


class UpstreamLimitError(RuntimeError):
    """What was asked for runs in DeepSpeed's (or torch's) own code, and the
    installed version of it cannot run it on this device. The message names
    the version, the device and the way around it (another mode, or a newer
    release); ds_pipe_ckpt raises it before calling into that code, instead of
    the library's own failure (:mod:`ds_pipe_ckpt.compat`)."""
