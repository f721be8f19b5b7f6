"""pytest tests/distributed/test_step_gathers.py — stage 3 with a prefetch budget issues the next
forward's first gathers during the update (Note [next forward's gathers in the step] in
zerorun/zero/step_gathers.py), and nothing reads a rounded or stale value because of it.

Two gloo ranks, a chain of six Linear(16, 16) layers and a head whose weight the parent reads
(``F.linear``), every Linear its own unit, qwZ on (the gathered copies are rounded, the masters
exact), AdamW with clipping, one unit per optimizer call. Three runs of 4 steps: the budget
(three layers' elements) with ``overlap_comm`` on, the same with it off (the gathers wait for
the forward, as before), and no budget:
- losses, the weights read through ``GatheredParameters`` right after every other step, and the
  full state dict right after the last one are the same, bit for bit; in the first run those
  reads find gathers in flight, so they must settle them (under qwZ an unsettled gather hands
  them rounded values);
- with it on, the update steps the forward's first units first, and each optimizer call finds
  one more of their gathers in flight than the last, up to the first call's and its window's
  four; ``step()`` returns with those four in flight; the others leave none;
- a script that destroys the group right after ``step()`` (the ring between hosts moving the
  gathers) ends cleanly, the gathers waited and released first.
"""

from __future__ import annotations

import torch

from chain_with_head import LAYERS, WIDTH, ChainWithHead
from gloo_world import run_ranks

STEPS = 4
UNIT = WIDTH * WIDTH + WIDTH
FIRST_GATHERS = 4  # the forward's first call's unit and the three its window reaches


def config(budget: int, overlap: bool) -> dict:
    return {"gradient_clipping": 0.5,
            "zero": {"stage": 3, "allgather_bucket_size": 1, "param_persistence_threshold": 0,
                     "update_bucket_size": UNIT // 2, "prefetch_bucket_size": budget, "overlap_comm": overlap,
                     "quantized_weights": True, "quantization_block_size": 64}}


def in_flight(engine) -> int:
    from zerorun.zero.unit.storage import ParamState

    return sum(r.unit.state is ParamState.GATHERING for r in engine.gatherer.records)


def train(rank: int, budget: int, overlap: bool) -> dict:
    from zerorun.deepspeed.zero import GatheredParameters
    from zerorun.zero.engine import initialize

    torch.manual_seed(3)
    model = ChainWithHead()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine = initialize(model, optimizer, config(budget, overlap))
    seen: dict = {"per_call": [], "after_step": [], "before_reads": []}
    stepping = optimizer.step

    def step_and_note(*args, **kwargs):
        seen["per_call"][-1].append(in_flight(engine))
        return stepping(*args, **kwargs)

    optimizer.step = step_and_note
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, WIDTH, generator=gen), torch.randn(4, WIDTH, generator=gen)  # fitted over the steps
    losses, weights = [], []
    for step in range(STEPS):
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        seen["per_call"].append([])
        engine.step()
        seen["after_step"].append(in_flight(engine))
        losses.append(loss.item())
        if step % 2:
            seen["before_reads"].append(in_flight(engine))
            params = list(model.parameters())
            with GatheredParameters(params):
                weights.append([p.detach().clone().flatten().tolist() for p in params])
    full = {k: v.flatten().tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}
    return {"losses": losses, "weights": weights, "full": full, **seen}


def three_ways(rank: int) -> dict:
    return {"ahead": train(rank, 3 * UNIT, True), "in_forward": train(rank, 3 * UNIT, False),
            "default": train(rank, 0, True)}


def test_the_step_issues_the_next_forwards_first_gathers_and_changes_no_value(tmp_path):
    results = run_ranks(three_ways, 2, tmp_path)
    for rank, runs in results.items():
        ahead = runs["ahead"]
        for other in ("in_forward", "default"):
            for key in ("losses", "weights", "full"):
                assert ahead[key] == runs[other][key], (rank, other, key)
        assert ahead["losses"][-1] < ahead["losses"][0], (rank, ahead["losses"])  # it trained
        units = LAYERS + 1
        # One unit per optimizer call, the forward's first units first: call k finds k of their
        # gathers in flight, up to all four; step() returns with them in flight, and the reads
        # right after it find them so.
        expected = [min(k, FIRST_GATHERS) for k in range(units)]
        assert ahead["per_call"] == [expected] * STEPS, (rank, ahead["per_call"])
        assert ahead["after_step"] == [FIRST_GATHERS] * STEPS, (rank, ahead["after_step"])
        assert ahead["before_reads"] == [FIRST_GATHERS] * (STEPS // 2), (rank, ahead["before_reads"])
        for other in ("in_forward", "default"):
            assert runs[other]["per_call"] == [[0] * units] * STEPS, (rank, other)
            assert runs[other]["after_step"] == [0] * STEPS, (rank, other)


def destroy_right_after_step(rank: int) -> dict:
    """Between hosts (the ring driver moves the gathers) a script ends as scripts do: a barrier
    and ``destroy_process_group()`` right after its last step."""
    import os

    import torch.distributed as dist

    from zerorun.zero.engine import initialize

    os.environ["ZERORUN_HOST_CHANNEL"] = "0"  # the ring between hosts (Note [ring progress])
    torch.manual_seed(3)
    model = ChainWithHead()
    engine = initialize(model, torch.optim.AdamW(model.parameters(), lr=0.05), config(3 * UNIT, True))
    for _ in range(2):
        engine.backward(engine(torch.randn(4, WIDTH)).square().mean())
        engine.step()
    before = in_flight(engine)
    dist.barrier()
    dist.destroy_process_group()
    return {"before": before, "after": in_flight(engine), "left": engine.updater.refresh.in_flight()}


def test_destroying_the_group_finishes_the_step_gathers_first(tmp_path):
    """Note [settled before teardown]: the wrapped destroy settles the gathers first."""
    results = run_ranks(destroy_right_after_step, 2, tmp_path, leave_together=False)
    for rank, result in results.items():
        assert result == {"before": FIRST_GATHERS, "after": 0, "left": 0}, (rank, result)
