"""The CPU dry run of ``tests/gpu/engine_checks.py`` (``DS_PIPE_CKPT_GPU_TESTS_ON_CPU=1``:
gloo, a tiny model, launched as ``tests/gpu/run.sh`` launches it): every check passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ds_pipe_ckpt.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "tests" / "gpu"


def test_the_engine_checks_pass_on_cpu(tmp_path):
    """The CPU dry run of tests/gpu/engine_checks.py: every check, the steps
    planned and measured, losses bit for bit those without checkpointing."""
    env = {**os.environ, "DS_PIPE_CKPT_GPU_TESTS_ON_CPU": "1", "DS_ACCELERATOR": "cpu", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}
    out = tmp_path / "engine.json"
    result = subprocess.run([sys.executable, str(GPU / "engine_checks.py"), "--json", str(out)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    assert "engine checks: 4 passed, 0 failed" in result.stdout
    report = json.loads(out.read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert len(checks) == 4 and all(c["passed"] and c["bitwise_equal_losses"] for c in checks.values()), checks
    for name, check in checks.items():
        if "selective" in name:
            continue
        steps = check["run"]["steps"]
        planned = [s for s in steps if s["planned"]]
        assert planned and all(s["peak_bytes"] is not None for s in planned), (name, steps)
        assert check["budget_bytes"] >= check["planned_peak_bytes"] > 0, name
