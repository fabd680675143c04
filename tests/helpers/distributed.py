"""Run a function on N local CPU ranks (gloo over loopback) and collect results.

Each rank runs in a fresh ``spawn`` process with the environment DeepSpeed's
launcher would give it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) and
``DS_ACCELERATOR=cpu``. A rank that raises, dies or outlives ``timeout`` fails
the call with :class:`RankFailure`, which names the rank and carries its traceback.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable


class RankFailure(AssertionError):
    """One or more ranks of a distributed test failed."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple,
               env: dict, results: Any) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        **env,
    })
    try:
        import torch
        torch.set_num_threads(1)
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        value = fn(*args)
        # Serialise with torch.save: tensors put on a multiprocessing queue directly
        # travel as shared-memory handles that die with this process.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report everything, including KeyboardInterrupt/SystemExit
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300,
              env: dict | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the per-rank results in rank order.

    ``fn`` must be importable (module level) and its result picklable.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, env or {}, results),
                         name=f"rank{r}", daemon=True) for r in range(world_size)]
    for proc in procs:
        proc.start()
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    failure = None
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcome))
                failure = f"timed out after {timeout:.0f}s; ranks {missing} did not finish"
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outcome and p.exitcode not in (None, 0)]
                if dead:
                    failure = "; ".join(f"rank {r} died with exit code {procs[r].exitcode}" for r in dead)
                    break
                continue
            outcome[rank] = (status, value)
            if status == "error":
                failure = f"rank {rank} of {world_size} raised:\n{value}"
                break
    finally:
        for proc in procs:
            proc.join(timeout=5 if failure is None else 0.5)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failure is not None:
        raise RankFailure(f"{getattr(fn, '__name__', fn)}: {failure}")
    import torch
    return [torch.load(io.BytesIO(outcome[r][1]), weights_only=False) for r in range(world_size)]
