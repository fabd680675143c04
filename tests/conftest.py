import os

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


# DeepSpeed's own limits on the version installed (ds_pipe_ckpt.compat): a test
# whose path runs into one is skipped with the limit's message, not failed.
# Only ds_pipe_ckpt's UpstreamLimitError counts (raised here, in a rank of
# run_ranks, or in a launched job), and only where the installed DeepSpeed has
# that limit; any other failure stays a failure.
UPSTREAM_LIMIT = "UpstreamLimitError: "


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and call.excinfo is not None:
        from ds_pipe_ckpt.errors import UpstreamLimitError

        error = call.excinfo.value
        text = str(error)
        if isinstance(error, UpstreamLimitError):
            reason = text
        elif UPSTREAM_LIMIT in text:
            reason = text.split(UPSTREAM_LIMIT, 1)[1].splitlines()[0]
        else:
            return report
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1], f"DeepSpeed's own limit here: {reason}")
    return report
