"""pytest -m long tests/distributed/test_gloo_world.py — Note [one world helper] in gloo_world.py:
``run_ranks`` returns what each rank's body returned, after a real collective of the group it
joined; a body that raises fails the call (so a folded test can fail); ``end_rank_now`` delivers
a rank's value from a broken world."""

from __future__ import annotations

import pytest
from gloo_world import end_rank_now, run_ranks

pytestmark = pytest.mark.long  # the default run must not grow; the folded tests use the helper


def summed(rank: int, offset: int) -> dict:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(rank + offset)])
    dist.all_reduce(total)
    return {"rank": rank, "total": total.item(), "pair": (rank, offset)}


def fails_on_rank_1(rank: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 says no")
    return rank


def ends_at_once(rank: int) -> None:
    end_rank_now({"ended": rank})


def test_every_rank_returns_its_value_as_json_carries_it(tmp_path):
    results = run_ranks(summed, 3, tmp_path, 10)
    assert results == {rank: {"rank": rank, "total": 33.0, "pair": [rank, 10]} for rank in range(3)}


def test_a_body_that_raises_fails_the_call(tmp_path):
    import torch.multiprocessing as mp

    # Rank 1's error, or rank 0's broken exit barrier, whichever torch reports first.
    with pytest.raises(mp.ProcessRaisedException):
        run_ranks(fails_on_rank_1, 2, tmp_path)


def test_end_rank_now_delivers_without_leaving_together(tmp_path):
    assert run_ranks(ends_at_once, 2, tmp_path) == {0: {"ended": 0}, 1: {"ended": 1}}
