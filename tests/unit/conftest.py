"""The in-process tier: a test here must not start ranks or launch a Python
process (that belongs in tests/multirank), so `make test-fast` stays fast."""

import multiprocessing.process
import subprocess
import sys

import pytest


def _refuse(what: str) -> None:
    raise RuntimeError(f"tests/unit is the in-process tier and this test {what}: move it to tests/multirank "
                       "(or its engine part, keeping the in-process checks here)")


@pytest.fixture(autouse=True)
def stays_in_process(monkeypatch):
    def start(self):
        _refuse(f"starts a process ({self.name})")

    popen_init = subprocess.Popen.__init__

    def popen(self, args, *rest, **kwargs):
        argv = [args] if isinstance(args, (str, bytes)) else list(args)
        program = str(argv[0]) if argv else ""
        if program == sys.executable or program.endswith(("python", "python3", "deepspeed", "torchrun")):
            _refuse(f"launches {program}")
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
