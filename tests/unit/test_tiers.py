"""The in-process tier keeps itself: a test here that starts a process or
launches Python is refused with the folder it belongs in."""

import multiprocessing
import subprocess
import sys

import pytest

from ds_pipe_ckpt.testing import run_ranks


def _noop() -> None:
    pass


def test_starting_ranks_here_is_refused():
    with pytest.raises(RuntimeError, match="tests/unit is the in-process tier .* move it to tests/multirank"):
        run_ranks(_noop, 1, timeout=10)
    with pytest.raises(RuntimeError, match="starts a process"):
        multiprocessing.get_context("spawn").Process(target=_noop).start()


def test_launching_python_here_is_refused_other_programs_run():
    with pytest.raises(RuntimeError, match=f"launches {sys.executable}"):
        subprocess.run([sys.executable, "-c", "pass"])
    assert subprocess.run(["bash", "-c", "exit 3"]).returncode == 3
