"""Run a function on N local ranks (gloo over loopback, one process each) and
collect what each returns.

Each rank is a fresh ``spawn`` process with the environment DeepSpeed's
launcher gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) and
calls ``deepspeed.init_distributed`` (gloo by default) before ``fn``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

__all__ = ["RankError", "run_ranks"]


class RankError(RuntimeError):
    """A rank raised, died or did not finish in time."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, backend: str, fn: Callable[..., Any],
               args: tuple, results: Any) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    })
    try:
        import deepspeed
        import torch.distributed as dist

        with contextlib.redirect_stdout(sys.stderr):  # keep DeepSpeed's set-up messages off stdout
            deepspeed.init_distributed(dist_backend=backend, verbose=False)
        try:
            results.put((rank, None, fn(*args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # reported to the parent, which raises RankError
        results.put((rank, traceback.format_exc(), None))


def _other_errors(results: Any, wait: float = 5.0) -> str:
    """Errors the other ranks report within ``wait`` seconds (a rank's failure
    often shows first as a lost connection on its peers)."""
    reports = []
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            rank, error, _ = results.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if error is not None:
            reports.append(f"\nrank {rank} raised:\n{error}")
    return "".join(reports)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout: float = 300) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return their results in rank order.

    ``fn`` must be importable by module and name, and its result picklable.
    Raises :class:`RankError` naming the rank that failed and carrying its traceback.
    """
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_rank_main, args=(rank, world_size, port, backend, fn, args, results),
                                 name=f"benchmark-rank{rank}", daemon=True)
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    outcomes: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            try:
                rank, error, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(processes) if r not in outcomes and p.exitcode not in (None, 0)]
                if dead:
                    raise RankError(f"rank {dead[0]} exited with code {processes[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    raise RankError(f"ranks did not finish within {timeout:.0f} s") from None
                continue
            if error is not None:
                raise RankError(f"rank {rank} of {world_size} raised:\n{error}{_other_errors(results)}")
            outcomes[rank] = value
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
    return [outcomes[rank] for rank in range(world_size)]
