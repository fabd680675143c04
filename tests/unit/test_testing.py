"""``ds_pipe_ckpt.testing``'s helpers that need no ranks (the rank runner
itself is tested in ``tests/multirank/test_rank_runner.py``)."""


def test_deepspeeds_shared_memory_buffers_of_a_port_are_removed(tmp_path):
    """DeepSpeed's CPU all-reduce leaves a 66 MiB /dev/shm file per rank
    (``deepspeed_allreduce_buffer_<n>_<addr>_<port>_<rank>``); only those of
    the given port go."""
    from ds_pipe_ckpt.testing import remove_shm_buffers

    ours = [tmp_path / f"deepspeed_allreduce_buffer_0_127.0.0.1_29611_{rank}" for rank in range(3)]
    others = [tmp_path / "deepspeed_allreduce_buffer_0_127.0.0.1_29612_0", tmp_path / "unrelated_29611_0"]
    for path in ours + others:
        path.write_bytes(b"x")
    assert remove_shm_buffers(29611, tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in others)
