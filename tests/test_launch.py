"""Local ranks: launch and the rank pool report results and errors per rank."""

import os

import pytest
import torch.distributed as dist

from sharded import launch


def _whoami(offset):
    return dist.get_rank() + offset, int(os.environ["WORLD_SIZE"])


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise KeyError("boom on rank 1")
    return "fine"


def test_launch_returns_per_rank_results():
    assert launch(_whoami, 2, 10) == [(10, 2), (11, 2)]


def test_pool_reraises_the_rank_error_with_its_traceback(on_ranks):
    with pytest.raises(KeyError, match="boom on rank 1") as info:
        on_ranks(2, _fail_on_rank_1)
    assert "raised on local rank 1; ranks [1] failed" in "\n".join(info.value.__notes__)
    assert on_ranks(2, _whoami, 0) == [(0, 2), (1, 2)]  # the pool is still usable


def _unpicklable_result():
    return lambda: None


def test_an_unpicklable_result_is_an_error_not_a_hang(on_ranks):
    with pytest.raises(RuntimeError, match="result cannot be sent to the parent process"):
        on_ranks(2, _unpicklable_result, timeout=60)
