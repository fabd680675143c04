"""The rank runner every multi-process test and benchmark uses: results come
back in rank order, and a failing or hanging rank is named instead of
leaving the caller waiting."""

import time

import pytest
import torch
import torch.distributed as dist

from ds_pipe_ckpt.testing import RankFailure, run_ranks


def rank_and_sum() -> tuple[int, torch.Tensor]:
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return dist.get_rank(), value


def fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 would wait here forever without the runner's report


def sleep_on_rank_zero() -> None:
    dist.barrier()  # both ranks are up: rank 1 reports at once, however slow the start-up was
    if dist.get_rank() == 0:
        time.sleep(300)


def test_results_come_back_in_rank_order_with_tensors():
    results = run_ranks(rank_and_sum, 2, timeout=120)
    assert [rank for rank, _ in results] == [0, 1]
    assert all(torch.equal(total, torch.tensor([3.0])) for _, total in results)


def test_a_rank_that_raises_is_named_with_its_traceback():
    with pytest.raises(RankFailure, match=r"(?s)^fail_on_rank_one: rank 1 of 2 raised:.*ValueError: deliberate failure on rank 1"):
        run_ranks(fail_on_rank_one, 2, timeout=120)


def test_a_rank_that_hangs_is_named_after_the_timeout():
    """The timeout counts from the spawn: it must cover the ranks' start-up
    (importing torch and DeepSpeed, the rendezvous), which took over 25 s on a
    loaded 2-core CI machine."""
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"timed out after 60 s; rank\(s\) \[0\] did not finish"):
        run_ranks(sleep_on_rank_zero, 2, timeout=60)
    assert time.monotonic() - start < 120  # the hanging rank is killed, not waited for


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
