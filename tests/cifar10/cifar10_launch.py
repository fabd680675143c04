"""Launch a training script the way users do: DeepSpeed's ``deepspeed`` launcher,
one log file per rank, a hard timeout, and a failure report that names the
rank that failed and shows its output."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.distributed import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
DEEPSPEED = Path(sys.executable).with_name("deepspeed")
# Lines of a rank's log (and of the launcher's output) shown in a failure report.
REPORT_LINES = 40


class LaunchFailure(AssertionError):
    """The launch failed or timed out; the message names the failed rank(s)."""


def rank_logs(log_dir: Path) -> dict[int, Path]:
    """The per-rank logs the launcher wrote (``<timestamp>_rank<R>.log``), by rank."""
    logs = {}
    for path in log_dir.glob("*_rank*.log"):
        match = re.search(r"_rank(\d+)\.log$", path.name)
        if match:
            logs[int(match.group(1))] = path
    return logs


def _tail(text: str, lines: int = REPORT_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def failure_report(headline: str, launcher_output: str, log_dir: Path) -> str:
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


def deepspeed_launch(script: Path, num_ranks: int, script_args: list[str], log_dir: Path,
                     timeout: float) -> str:
    """``deepspeed --num_gpus N script ARGS`` from the repository root on CPU;
    return the launcher's output. Raises :class:`LaunchFailure` on a non-zero
    exit or after ``timeout`` seconds (the whole launch is killed then)."""
    command = [str(DEEPSPEED), "--num_gpus", str(num_ranks), "--master_port", str(free_port()),
               "--enable_each_rank_log", str(log_dir), str(script), *script_args]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    # Own session: the launcher, its launch.py and the ranks share one process
    # group, which a timeout kills as a whole.
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise LaunchFailure(failure_report(f"{' '.join(command)}\ntimed out after {timeout:.0f} s",
                                           output, log_dir)) from None
    if process.returncode != 0:
        raise LaunchFailure(failure_report(
            f"{' '.join(command)}\nexited with code {process.returncode} after {time.monotonic() - start:.0f} s",
            output, log_dir))
    return output
