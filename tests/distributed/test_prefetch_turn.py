"""pytest tests/distributed/test_prefetch_turn.py — stage 3's window running on from forward's end
into backward (Note [forward runs on into backward] in zerorun/zero/gather_prefetch.py) changes
when units are gathered and released, never what the model computes.

Two gloo ranks, the tiny GPT of examples/gpt.py (a tied head, every block and MLP its own unit),
3 steps, each configuration with ``prefetch_bucket_size`` 0 and with a budget of one attention unit:
- bf16 with the parameters offloaded to the host, every block recomputed in backward;
- fp32 with the optimizer on the host, 2 micro-steps of gradient accumulation and clipping.
Every loss and the final weights are the same bits with and without the budget, and with the
budget every step from the second on (the first micro-step records the orders) gathers fewer
units (one per micro-step here: 12 -> 11 a step recomputing, 20 -> 18 accumulating 2): what the
window reaches in backward's order stays gathered from its forward.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from gloo_world import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

# The tiny GPT's units: per block 148,992 elements (attention and its norms) and 295,872 (MLP),
# the final norm 384: a budget of about one attention unit.
BUDGET = 150_000
CASES = {
    "bf16+params-on-host+recompute": ({"precision": {"dtype": "bf16"},
                                       "zero": {"offload_param": {"device": "cpu"}},
                                       "activation_checkpointing": {"enabled": True, "modules": ["Block"]}}, 1),
    "fp32+optimizer-on-host+accumulation": ({"zero": {"offload_optimizer": {"device": "cpu"}},
                                             "gradient_clipping": 0.5}, 2),
}


def train(rank: int, extra: dict, accumulation: int, budget: int) -> dict:
    import zerorun
    from gpt import GPT, preset, rank_slice, synthetic_batch
    from zerorun.zero.unit.storage import ParamState

    cfg = preset("tiny")
    torch.manual_seed(0)
    model = GPT(cfg)
    zero = {"stage": 3, "param_persistence_threshold": 0, "prefetch_bucket_size": budget, **extra.get("zero", {})}
    config = {**extra, "zero": zero, "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": accumulation}}
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    gathers = [0]

    def count(unit) -> None:
        gathers[0] += unit.state is ParamState.GATHERING

    for record in engine.gatherer.records:
        record.unit.state_listeners.append(count)
    losses, per_step = [], []
    carried = 0
    for step in range(3):
        gathers[0] = carried
        for micro in range(accumulation):
            tokens, targets = synthetic_batch(cfg, 4, step=step * accumulation + micro)
            loss = engine(rank_slice(tokens, rank, 2), rank_slice(targets, rank, 2))
            engine.backward(loss)
            before = gathers[0]
            engine.step()
            # Note [next forward's gathers in the step]: counted with the forward that uses them
            carried, gathers[0] = gathers[0] - before, before
            losses.append(loss.float().item().hex())
        per_step.append(gathers[0])
    state = engine.full_state_dict(rank0_only=False)
    return {"losses": losses, "gathers": per_step,
            "state": {k: v.float().reshape(-1)[::97].tolist() for k, v in state.items()}}


def both(rank: int) -> dict:
    return {name: {"default": train(rank, extra, accumulation, 0), "budget": train(rank, extra, accumulation, BUDGET)}
            for name, (extra, accumulation) in CASES.items()}


def test_the_turn_into_backward_moves_gathers_not_values(tmp_path):
    for rank, cases in run_ranks(both, 2, tmp_path).items():
        for name, runs in cases.items():
            default, budget = runs["default"], runs["budget"]
            assert budget["losses"] == default["losses"], (rank, name)
            assert budget["state"] == default["state"], (rank, name)
            # fewer gathers once an order is recorded: from the first step's second micro-step on
            pairs = list(zip(budget["gathers"], default["gathers"], strict=True))
            assert all(b <= d for b, d in pairs) and all(b < d for b, d in pairs[1:]), \
                (rank, name, budget["gathers"], default["gathers"])
