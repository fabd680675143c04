import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def default_checkpointing_settings():
    """Every test starts (and leaves) ds_pipe_ckpt with default settings."""
    from ds_pipe_ckpt.settings import restore_defaults
    restore_defaults()
    yield
    restore_defaults()


@pytest.fixture(scope="session")
def single_rank_process_group():
    """A one-rank gloo process group in the test process (PipelineModule needs one)."""
    import deepspeed
    import torch.distributed as dist

    from ds_pipe_ckpt.testing import free_port

    if not dist.is_initialized():
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                           "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    yield


@pytest.fixture
def model_parallel_tracker():
    """DeepSpeed's model-parallel RNG tracker with one seeded stream, restored afterwards."""
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

    tracker = ds_checkpointing.get_cuda_rng_tracker()
    saved = tracker.get_states(), set(tracker.seeds_)
    tracker.reset()
    tracker.add("model-parallel-rng", 4321)
    yield tracker
    tracker.set_states(saved[0])
    tracker.seeds_ = saved[1]


# -- tiers --------------------------------------------------------------------------
# A test's marker follows its folder (pytest.ini lists them): tests/unit is the
# in-process tier (`make test-fast`), the others start ranks, train examples or
# need a GPU.
FOLDER_MARKERS = {"multirank": ("multirank",), "benchmarks": ("slow",), "cifar10": ("slow",), "gpt": ("slow",),
                  "llama": ("slow",), "gpu": ("gpu",)}
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    from ds_pipe_ckpt import compat

    reentrant_runs = compat.deepspeed_reentrant_runs()
    for item in items:
        folder = Path(item.path).resolve().relative_to(TESTS).parts[0]
        for name in FOLDER_MARKERS.get(folder, ()):
            item.add_marker(name)
        # Decided before the test runs, from the installed DeepSpeed and accelerator.
        if item.get_closest_marker("deepspeed_reentrant") and not reentrant_runs:
            item.add_marker(pytest.mark.skip(reason=f"DeepSpeed {compat.deepspeed.__version__}'s reentrant "
                                                    "checkpoint cannot run on this accelerator (it can from 0.19)"))
