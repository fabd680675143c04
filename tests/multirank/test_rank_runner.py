"""The rank runner every multi-process test and benchmark uses: results come
back in rank order, and a failing or hanging rank is named instead of
leaving the caller waiting."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from ds_pipe_ckpt.testing import RankFailure, rank_start_method, run_ranks


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


def environment_value(name: str) -> str | None:
    return os.environ.get(name)


def test_ranks_see_the_callers_environment_as_it_is_now(monkeypatch):
    """A fork server keeps the environment it started with: the ranks get the caller's current one."""
    run_ranks(rank_and_sum, 2, timeout=120)  # the server (if any) is up before the change
    monkeypatch.setenv("DS_PIPE_CKPT_RANK_RUNNER_PROBE", "set after the start")
    assert run_ranks(environment_value, 2, "DS_PIPE_CKPT_RANK_RUNNER_PROBE", timeout=120) == ["set after the start"] * 2
    assert run_ranks(environment_value, 2, "RANK", timeout=120) == ["0", "1"]


def test_results_come_back_in_rank_order_with_tensors():
    results = run_ranks(rank_and_sum, 2, timeout=120)
    assert [rank for rank, _ in results] == [0, 1]
    assert all(torch.equal(total, torch.tensor([3.0])) for _, total in results)


def test_a_rank_that_raises_is_named_with_its_traceback():
    with pytest.raises(RankFailure, match=r"(?s)^fail_on_rank_one: rank 1 of 2 raised:.*ValueError: deliberate failure on rank 1"):
        run_ranks(fail_on_rank_one, 2, timeout=120)


def test_a_rank_that_hangs_is_named_after_the_timeout():
    """The timeout counts from the start: it must cover the ranks' start-up.
    Forked from the preloaded server (DS_ACCELERATOR=cpu, once a first call
    has started it) that is the rendezvous, about 1 s; spawned, importing
    torch and DeepSpeed took over 25 s on a loaded 2-core machine."""
    timeout = 10 if rank_start_method() == "forkserver" else 40
    run_ranks(rank_and_sum, 2, timeout=120)  # the server is up
    start = time.monotonic()
    with pytest.raises(RankFailure, match=rf"timed out after {timeout} s; rank\(s\) \[0\] did not finish"):
        run_ranks(sleep_on_rank_zero, 2, timeout=timeout)
    assert time.monotonic() - start < 2 * timeout  # the hanging rank is killed, not waited for
