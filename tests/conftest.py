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
