"""The two checkpoint modes as pytest parameters of ``use_reentrant``. The
reentrant mode runs DeepSpeed's reentrant checkpoint, so it carries the
``deepspeed_reentrant`` marker: skipped before it runs where that cannot run
(DeepSpeed before 0.19 on a CPU, ``ds_pipe_ckpt.compat.deepspeed_reentrant_runs``)."""

import pytest

REENTRANT = pytest.param(True, id="reentrant", marks=pytest.mark.deepspeed_reentrant)
NON_REENTRANT = pytest.param(False, id="non_reentrant")
MODES = [REENTRANT, NON_REENTRANT]
