"""pytest tests/distributed/test_refresh_ahead.py — stages 1-2 finish the step's all-gather of
updated chunks during the next forward (Note [refresh on first read] in
zerorun/zero/refresh_ahead.py), and nothing reads a value from before the step.

Two gloo ranks, a chain of six Linear(16, 16) layers and a head Linear whose forward never runs:
the parent reads its weight through ``F.linear``, every Linear its own unit
(``reduce_bucket_size`` of one layer). Stages 1 and 2 train 4 steps of AdamW with
``overlap_comm`` on (the default) and off:
- losses, the weights read right after every other step (a script's EMA or logging reads them there),
  and, after a checkpoint saved right after the last step, the module's ``state_dict()`` and
  the consolidated weights are the same, bit for bit;
- with it on, ``step()`` returns with every unit's all-gather unwaited; when the first layer's
  forward begins, the units of the later layers are still unwaited (the forward computes while
  they arrive), and after the forward none is.
"""

from __future__ import annotations

import torch
from torch import nn

from chain_with_head import LAYERS, WIDTH, ChainWithHead
from gloo_world import run_ranks

STEPS = 4


def train(rank: int, stage: int, overlap: bool, save_dir: str) -> dict:
    from zerorun.zero.engine import initialize

    torch.manual_seed(3)
    model = ChainWithHead()
    config = {"zero": {"stage": stage, "reduce_bucket_size": WIDTH * WIDTH + WIDTH, "overlap_comm": overlap}}
    engine = initialize(model, torch.optim.AdamW(model.parameters(), lr=0.05), config)
    refresh = engine.updater.refresh
    seen: dict = {"units": len(engine.records), "after_step": [], "at_first_layer": [], "after_forward": []}
    unwaited = refresh.in_flight if overlap else (lambda: 0)
    model.layers[0].register_forward_pre_hook(lambda *_: seen["at_first_layer"].append(unwaited()))
    gen = torch.Generator().manual_seed(rank)
    losses, weights = [], []
    for step in range(STEPS):
        x, y = torch.randn(4, WIDTH, generator=gen), torch.randn(4, WIDTH, generator=gen)
        out = engine(x)
        seen["after_forward"].append(unwaited())
        loss = ((out - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        seen["after_step"].append(unwaited())
        losses.append(loss.item())
        if step % 2:
            weights.append([p.detach().clone().flatten().tolist() for p in model.parameters()])
    engine.save_checkpoint(save_dir, tag="end")  # right after the last step: units still in flight
    state = {k: v.flatten().tolist() for k, v in model.state_dict().items()}
    full = {k: v.flatten().tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}
    return {"losses": losses, "weights": weights, "state": state, "full": full, **seen}


def both_ways(rank: int, tmp: str) -> dict:
    return {f"{stage}-{overlap}": train(rank, stage, overlap, f"{tmp}/ckpt-{stage}-{overlap}")
            for stage in (1, 2) for overlap in (True, False)}


def test_refresh_ahead_overlaps_the_next_forward_and_changes_no_value(tmp_path):
    results = run_ranks(both_ways, 2, tmp_path, str(tmp_path))
    for rank, runs in results.items():
        for stage in (1, 2):
            ahead, eager = runs[f"{stage}-True"], runs[f"{stage}-False"]
            for key in ("losses", "weights", "state", "full"):
                assert ahead[key] == eager[key], (rank, stage, key)
            units = ahead["units"]
            assert units == LAYERS + 1
            # step() returns with every unit's all-gather unwaited ...
            assert ahead["after_step"] == [units] * STEPS, (rank, stage)
            # ... the first layer's forward starts with all of them still unwaited (none before
            # the first step; none after a step whose weights were read), and the forward has
            # waited for every one, the head's too.
            assert ahead["at_first_layer"] == [0, units, 0, units], ahead["at_first_layer"]
            assert ahead["after_forward"] == [0] * STEPS
        assert runs["1-True"]["losses"] != runs["1-True"]["losses"][:1] * STEPS  # it trained


def destroy_right_after_step(rank: int) -> dict:
    """Between hosts (the ring driver moves the refresh) a script ends as scripts do: a barrier and
    ``destroy_process_group()`` right after its last step, with every refresh unwaited."""
    import os

    import torch.distributed as dist

    from zerorun.zero.engine import initialize

    os.environ["ZERORUN_HOST_CHANNEL"] = "0"  # the ring between hosts (Note [ring progress])
    torch.manual_seed(3)
    model = ChainWithHead()
    engine = initialize(model, torch.optim.AdamW(model.parameters(), lr=0.05),
                        {"zero": {"stage": 1, "reduce_bucket_size": WIDTH * WIDTH + WIDTH}})
    for _ in range(2):
        engine.backward(engine(torch.randn(4, WIDTH)).square().mean())
        engine.step()
    before = engine.updater.refresh.in_flight()
    dist.barrier()
    dist.destroy_process_group()
    return {"before": before, "after": engine.updater.refresh.in_flight(),
            "plain": all(type(p) is nn.Parameter for p in model.parameters())}


def test_destroying_the_group_finishes_the_refresh_first(tmp_path):
    """Note [settled before teardown]: destroying the group under a refresh in flight aborted the
    rank ("terminate called without an active exception"); the wrapped destroy waits for it."""
    results = run_ranks(destroy_right_after_step, 2, tmp_path, leave_together=False)
    for rank, result in results.items():
        assert result == {"before": LAYERS + 1, "after": 0, "plain": True}, (rank, result)
