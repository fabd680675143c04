import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def default_checkpointing_settings():
    """Every test starts (and leaves) ds_pipe_ckpt with default settings."""
    import ds_pipe_ckpt
    ds_pipe_ckpt.configure()
    yield
    ds_pipe_ckpt.configure()


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
