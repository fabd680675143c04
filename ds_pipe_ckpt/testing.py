"""Run code on several local ranks, as tests and benchmarks of a DeepSpeed
pipeline need to: in-process workers (:func:`run_ranks`) or a real
``deepspeed`` launch (:func:`deepspeed_launch`).

Both have a hard timeout and, when something fails, raise an exception that
names the rank(s) that failed and carries their traceback or log tail, so a
hung or crashed rank never leaves the caller waiting for gloo's timeout.

On a machine without a GPU set ``DS_ACCELERATOR=cpu``; the ranks then use the
gloo backend over loopback.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import queue as queue_module
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["RankFailure", "LaunchFailure", "free_port", "run_ranks", "rank_start_method", "deepspeed_launch", "rank_logs", "remove_shm_buffers"]


class RankFailure(RuntimeError):
    """A rank raised, died or did not finish in time (:func:`run_ranks`)."""


class LaunchFailure(RuntimeError):
    """A ``deepspeed`` launch exited non-zero or timed out (:func:`deepspeed_launch`)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Imported once by the fork server that ranks fork from where DS_ACCELERATOR=cpu,
# instead of by every rank (about 4 CPU-seconds each). With CUDA, forking after
# DeepSpeed's accelerator probe is unsafe: ranks are spawned.
PRELOADED_MODULES = ("torch", "torch.distributed", "deepspeed", "ds_pipe_ckpt")


def rank_start_method() -> str:
    """How :func:`run_ranks` starts a rank: ``"forkserver"`` (the preloaded
    server, :data:`PRELOADED_MODULES`) where ``DS_ACCELERATOR=cpu``, else ``"spawn"``."""
    return "forkserver" if os.environ.get("DS_ACCELERATOR") == "cpu" else "spawn"


def _rank_context() -> Any:
    """The multiprocessing context of :func:`rank_start_method`."""
    if rank_start_method() == "spawn":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED_MODULES))  # read when the server starts, once per process
    return context


def _rank_main(rank: int, world_size: int, port: int, backend: str, fn: Callable[..., Any], args: tuple,
               environ: dict, env: dict, threads: int, results: Any) -> None:
    # The caller's environment as it is now (a fork server's is that of its start), then the rank's.
    os.environ.clear()
    os.environ.update({
        **environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": str(threads),
        **env,
    })
    import torch
    import torch.distributed as dist
    try:
        torch.set_num_threads(threads)
        import deepspeed

        with contextlib.redirect_stdout(sys.stderr):  # keep DeepSpeed's set-up messages off stdout
            deepspeed.init_distributed(dist_backend=backend, verbose=False)
        value = fn(*args)
        # torch.save, not the queue's pickling: tensors put on a multiprocessing
        # queue travel as shared-memory handles that die with this process.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, None, buffer.getvalue()))
    except BaseException:  # KeyboardInterrupt and SystemExit too: the parent must hear of it
        # Reported before the process group is torn down: the teardown makes the
        # peers fail with lost connections, which must not arrive first.
        results.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _later_errors(results: Any, wait: float) -> str:
    """Errors other ranks report within ``wait`` seconds: one rank's failure
    often shows first as a lost connection on its peers, so the root cause
    may arrive second."""
    reports = []
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            rank, error, _ = results.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue_module.Empty:
            break
        if error is not None:
            reports.append(f"\nrank {rank} raised:\n{error}")
    return "".join(reports)


def remove_shm_buffers(port: int, directory: str | os.PathLike = "/dev/shm") -> int:
    """Remove the shared-memory all-reduce buffers that DeepSpeed's CPU
    communication (``deepspeed/ops/csrc/cpu/comm/shm.cpp``) creates per rank,
    named by the master address and ``port``, and never unlinks: 66 MiB each,
    in RAM, outliving their processes (a full test run left about 3 GiB).
    Call once the ranks of that port are gone. Returns how many were removed."""
    removed = 0
    for path in Path(directory).glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300,
              backend: str = "gloo", env: dict | None = None, threads: int = 1) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` local ranks; return their results in rank order.

    Each rank is a new process (forked from a server that has imported
    :data:`PRELOADED_MODULES` where ``DS_ACCELERATOR=cpu``, else ``spawn``)
    with the caller's environment, what DeepSpeed's launcher gives a rank
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT``) and ``env``, ``threads`` torch threads,
    and ``deepspeed.init_distributed(backend)`` done before ``fn`` runs.
    ``fn`` must be importable by module and name; its result is sent back with
    ``torch.save``.

    Raises:
        RankFailure: a rank raised (its traceback, and those of ranks that
            failed right after it), exited without a result, or ``timeout``
            seconds passed (the ranks still running are named). Every rank
            process is gone when this returns or raises.
    """
    context = _rank_context()
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_main,
                                 args=(rank, world_size, port, backend, fn, args, dict(os.environ), env or {},
                                       threads, results),
                                 name=f"rank{rank}", daemon=True)
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    outcomes: dict[int, bytes] = {}
    deadline = time.monotonic() + timeout
    failure = None
    try:
        while len(outcomes) < world_size and failure is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                failure = f"timed out after {timeout:.0f} s; rank(s) {missing} did not finish"
                break
            try:
                rank, error, value = results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(processes) if r not in outcomes and p.exitcode not in (None, 0)]
                if dead:
                    failure = "; ".join(f"rank {r} exited with code {processes[r].exitcode}" for r in dead)
                continue
            if error is not None:
                failure = f"rank {rank} of {world_size} raised:\n{error}{_later_errors(results, 3.0)}"
            else:
                outcomes[rank] = value
    finally:
        for process in processes:
            process.join(timeout=5 if failure is None else 0.5)
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        remove_shm_buffers(port)
    if failure is not None:
        raise RankFailure(f"{getattr(fn, '__qualname__', fn)}: {failure}")
    import torch
    return [torch.load(io.BytesIO(outcomes[rank]), weights_only=False) for rank in range(world_size)]


# -- a real launch --------------------------------------------------------------------

# Lines of a rank's log (and of the launcher's output) shown in a failure report.
_REPORT_LINES = 40


def rank_logs(log_dir: Path) -> dict[int, Path]:
    """The per-rank logs ``deepspeed --enable_each_rank_log`` wrote
    (``<timestamp>_rank<R>.log``), by rank."""
    logs = {}
    for path in Path(log_dir).glob("*_rank*.log"):
        match = re.search(r"_rank(\d+)\.log$", path.name)
        if match:
            logs[int(match.group(1))] = path
    return logs


def _tail(text: str, lines: int = _REPORT_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _failure_report(headline: str, launcher_output: str, log_dir: Path) -> str:
    """Which ranks raised, with the end of their logs; else every rank's log tail."""
    paths = rank_logs(log_dir)
    logs = {rank: paths[rank].read_text(errors="replace") for rank in sorted(paths)}
    failed = {rank: text for rank, text in logs.items() if "Traceback (most recent call last)" in text}
    parts = [headline]
    if failed:
        parts.append(f"rank(s) {sorted(failed)} of {len(logs)} raised:")
        shown = failed
    else:
        parts.append(f"no rank raised a Python exception; the last lines of all {len(logs)} rank logs follow")
        shown = logs
    for rank, text in shown.items():
        parts.append(f"----- rank {rank} ({paths[rank]}) -----\n{_tail(text)}")
    parts.append(f"----- launcher output -----\n{_tail(launcher_output, 15)}")
    return "\n".join(parts)


def deepspeed_launch(script: str | os.PathLike, num_ranks: int, script_args: Sequence[str], log_dir: str | os.PathLike,
                     timeout: float, cwd: str | os.PathLike | None = None) -> str:
    """``deepspeed --num_gpus N script ARGS`` as a user runs it, one log per rank
    in ``log_dir``; return the launcher's output.

    Uses the ``deepspeed`` executable beside the running Python. On CPU
    (``DS_ACCELERATOR=cpu``, set here unless the environment sets another
    accelerator) each rank gets one OpenMP thread.

    Raises:
        LaunchFailure: a non-zero exit, or ``timeout`` seconds passed (the
            launcher and every rank are killed then); the message names the
            rank(s) that raised and shows the end of their logs.
    """
    deepspeed = Path(sys.executable).with_name("deepspeed")
    port = free_port()
    command = [str(deepspeed), "--num_gpus", str(num_ranks), "--master_port", str(port),
               "--enable_each_rank_log", str(log_dir), str(script), *script_args]
    env = {"DS_ACCELERATOR": "cpu", **os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    # Own session: the launcher, its launch.py and the ranks share one process
    # group, which a timeout kills as a whole.
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise LaunchFailure(_failure_report(f"{' '.join(command)}\ntimed out after {timeout:.0f} s",
                                            output, Path(log_dir))) from None
    finally:
        remove_shm_buffers(port)
    if process.returncode != 0:
        raise LaunchFailure(_failure_report(
            f"{' '.join(command)}\nexited with code {process.returncode} after {time.monotonic() - start:.0f} s",
            output, Path(log_dir)))
    return output
