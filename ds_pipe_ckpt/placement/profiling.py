"""Per-checkpoint timings (``activation_checkpointing.profile``).

For each checkpointed segment: the forward (from the call to the end of
storing its inputs), the gather (bringing the stored inputs back: host-to-device
copy and all-gather) and the recomputation. Each phase is bracketed by a
device synchronisation, as DeepSpeed's own timers do, so profiling slows
training down; leave it off outside measurements. Records are logged at INFO
level on the ``ds_pipe_ckpt`` logger and the most recent ones are kept.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["CheckpointRecord", "CheckpointProfiler"]

logger = logging.getLogger("ds_pipe_ckpt")


@dataclass
class CheckpointRecord:
    """Timings of one checkpointed segment, in seconds (None: not measured / not run yet)."""

    index: int
    label: str
    forward_s: float | None = None
    gather_s: float | None = None
    recompute_s: float | None = None
    saved_bytes: int = 0  # bytes of the segment's saved inputs
    kept_bytes: int = 0  # bytes this rank keeps for them (a shard, or host memory)

    def describe(self) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value * 1e3:.3f} ms"

        name = f"checkpoint {self.index}" + (f" ({self.label})" if self.label else "")
        return (f"{name}: forward {ms(self.forward_s)}, gather "
                f"{ms(self.gather_s)}, recompute {ms(self.recompute_s)}; inputs {self.saved_bytes} B, "
                f"kept {self.kept_bytes} B")


class CheckpointProfiler:
    """Times checkpoint phases around ``synchronize()`` calls and keeps the last ``keep`` records."""

    def __init__(self, synchronize: Callable[[], None], keep: int = 1024):
        self._synchronize = synchronize
        self.records: collections.deque[CheckpointRecord] = collections.deque(maxlen=keep)

    def start(self) -> float:
        self._synchronize()
        return time.perf_counter()

    def stop(self, started: float) -> float:
        self._synchronize()
        return time.perf_counter() - started

    def new_record(self, index: int, label: str) -> CheckpointRecord:
        record = CheckpointRecord(index, label)
        self.records.append(record)
        return record

    @staticmethod
    def log(record: CheckpointRecord, phase: str) -> None:
        logger.info("%s (%s done)", record.describe(), phase)
