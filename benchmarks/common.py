"""What every benchmark subject does the same way: record where and with what
it ran (:func:`machine_info`), and wait for the device before reading a clock
(:func:`synchronize`). Imported by :mod:`benchmarks.checkpointing` and
:mod:`benchmarks.pipeline`; it imports neither, nor anything measured by only one
of them.
"""

from __future__ import annotations

import datetime
import os
import platform

import deepspeed
import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info(device: torch.device, threads: int) -> dict:
    """Where and with what the benchmark ran."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{_cpu_model()}, {os.cpu_count()} logical CPUs, {threads} torch threads"
    return {
        "device": f"{device.type}: {name}",
        "summary": (f"{device.type}: {name}; torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
                    f"Python {platform.python_version()}, {platform.system()} {platform.release()}"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "load_average_at_start": os.getloadavg(),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA) before a clock is read; nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
