"""pytest tests/distributed/test_prefetch_budget.py — stage 3 prefetches within the config's
budget (Note [prefetch budget] in zerorun/zero/gather_prefetch.py).

Two gloo ranks, a chain of eight Linear(16, 16) layers, each its own unit (272 elements). At
each layer's forward, after the engine's own hook, the test notes which units are in flight:
- the default (``prefetch_bucket_size: 0``) prefetches the next layer only: one unit in flight;
- ``prefetch_bucket_size: 816`` (three layers' elements) keeps three in flight, 816 elements,
  never more;
- the same with ``max_live_parameters: 600`` gathers nothing ahead past 600 elements gathered
  or in flight: one in flight, at most 544 live (the running layer and the next).
Every configuration trains 3 steps with the same losses, bit for bit: prefetching moves when a
gather is issued, never what it brings.

Near the end of forward the window runs on into the recorded backward (Note [forward runs on
into backward]), from the second step on (the first records the orders and keeps nothing). With the budget, layers 6-8
stay gathered from their forward into backward, so a step gathers 13 units, not 16 less the one
the default keeps (15); the gathers of the next forward's first four (layer 1 and its window)
are issued inside ``step()`` (Note [next forward's gathers in the step]), so the first step
counts those four besides its 16; at the last layer's forward, backward's next four (layer 5, which the
first window reaches once layer 8 is held anyway, and backward's own window of three) are in
flight, and 7 units are live when forward returns. The default keeps only the last layer and
has nothing in flight at the turn. With ``max_live_parameters`` the turn stays within the cap.
``turn_prefetch_bucket_size`` sizes backward's own window apart from the budget: four layers'
elements put layers 5-1 in flight at the turn (8 live after forward), one layer's puts layers
5-4 (5 live); either way the same 13 gathers a step and the same losses.
"""

from __future__ import annotations

import json

import torch
from torch import nn

from gloo_world import spawn_and_collect

WIDTH, LAYERS, STEPS = 16, 8, 3
UNIT = WIDTH * WIDTH + WIDTH
CASES = {
    "default": {},
    "budget": {"prefetch_bucket_size": 3 * UNIT},
    "capped": {"prefetch_bucket_size": 3 * UNIT, "max_live_parameters": 600},
    "turn_wide": {"prefetch_bucket_size": 3 * UNIT, "turn_prefetch_bucket_size": 4 * UNIT},
    "turn_narrow": {"prefetch_bucket_size": 3 * UNIT, "turn_prefetch_bucket_size": UNIT},
}


def build() -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(*(m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())))


def train(rank: int, budget: dict) -> dict:
    """3 steps of one configuration; its losses, and the most units (and elements) in flight and
    elements live seen at any layer's forward."""
    from zerorun.zero.engine import initialize
    from zerorun.zero.unit.storage import ParamState

    model = build()
    config = {"zero": {"stage": 3, "allgather_bucket_size": 1, "param_persistence_threshold": 0, **budget}}
    engine = initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    gatherer = engine.gatherer
    units = [r.unit for r in gatherer.records]
    seen = {"in_flight": 0, "in_flight_elements": 0, "live": 0, "gathers": [], "live_after_forward": []}
    gathers = [0]

    def count_gathers(unit) -> None:
        gathers[0] += unit.state is ParamState.GATHERING

    for unit in units:
        unit.state_listeners.append(count_gathers)

    last = [m for m in model if isinstance(m, nn.Linear)][-1]

    def note(module, args):
        flying = [u for u in units if u.state is ParamState.GATHERING]
        if module is last:  # the turn into backward: its own window (Note [forward runs on into backward])
            seen["in_flight_at_turn"] = max(seen.get("in_flight_at_turn", 0), len(flying))
            seen["live"] = max(seen["live"], gatherer.prefetcher.live_elements)
            return
        seen["in_flight"] = max(seen["in_flight"], len(flying))
        seen["in_flight_elements"] = max(seen["in_flight_elements"], sum(u.layout.numel for u in flying))
        seen["live"] = max(seen["live"], gatherer.prefetcher.live_elements)

    for layer in model:
        if isinstance(layer, nn.Linear):
            layer.register_forward_pre_hook(note)
    losses = []
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(4, WIDTH, generator=gen), torch.randn(4, WIDTH, generator=gen)
        gathers[0] = 0
        out = engine(x)
        seen["live_after_forward"].append(gatherer.prefetcher.live_elements)
        loss = ((out - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        seen["gathers"].append(gathers[0])
        losses.append(loss.item())
    return {"losses": losses, **seen}


def worker(rank: int, rendezvous: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    result = {case: train(rank, budget) for case, budget in CASES.items()}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)


def test_prefetch_reaches_as_far_as_the_budget_and_the_live_cap_allow(tmp_path):
    results = spawn_and_collect(worker, tmp_path, 2)
    for rank, result in results.items():
        default, budget, capped = result["default"], result["budget"], result["capped"]
        wide, narrow = result["turn_wide"], result["turn_narrow"]
        assert default["in_flight"] == 1, (rank, default)
        assert budget["in_flight"] == 3 and budget["in_flight_elements"] == 3 * UNIT, (rank, budget)
        assert capped["in_flight"] == 1 and capped["live"] <= 600, (rank, capped)
        assert budget["losses"] == default["losses"] == capped["losses"], rank
        # The first step records the orders: nothing is kept, every layer is gathered twice. From
        # the second on, the default keeps the last layer into backward.
        assert default["gathers"] == [16, 15, 15] and default["live_after_forward"] == [0, UNIT, UNIT], (rank, default)
        assert default["in_flight_at_turn"] == 0, (rank, default)
        assert budget["gathers"] == [16 + 4, 13, 13], (rank, budget)
        assert budget["live_after_forward"] == [0, 7 * UNIT, 7 * UNIT], (rank, budget)
        assert budget["in_flight_at_turn"] == 4, (rank, budget)
        assert capped["live"] <= 600, (rank, capped)
        assert wide["in_flight_at_turn"] == 5 and wide["live_after_forward"][1:] == [8 * UNIT] * 2, (rank, wide)
        assert narrow["in_flight_at_turn"] == 2 and narrow["live_after_forward"][1:] == [5 * UNIT] * 2, (rank, narrow)
        assert wide["gathers"] == narrow["gathers"] == [16 + 4, 13, 13], rank
        assert wide["losses"] == narrow["losses"] == budget["losses"], rank
