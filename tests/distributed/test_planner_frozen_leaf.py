"""pytest tests/distributed/test_planner_frozen_leaf.py — the planner against the engine for models
that are not all trainable and all small modules: a frozen base with small adapters (LoRA-like),
and a mixture of experts whose expert blocks are gathered whole.

What is compared, per rank, stage and precision, with 2 gloo ranks on CPU: the planner's model
state columns (``zerorun.planner.memory.estimate`` over the model counted on the meta device)
against ``engine.memory_breakdown()`` after the second backward (Adam's state exists, gradients
are held), each family within 5% as in test_memory_formula.py; and, at stage 3, the most elements
the engine held gathered at once (its trained and frozen units, watched at every gather of the
second step) between half the planner's bound and the bound.

- Note [frozen units] (zero/unit/partition.py): frozen parameters have no gradient and no
  optimizer state at any stage; below stage 3 they are whole on every rank, at stage 3 they are
  partitioned too, in units of their own, in the model dtype (no master: Note [fp32 shard] is
  for trained chunks). The planner counted every parameter as trained: on the adapter model its
  gradient and optimizer columns were 12x the engine's, and its stage-3 bound on what is
  gathered at once left the frozen units out (2,304 elements; the engine gathered 20,160).
- Note [expert blocks] (zero/unit/leaf.py): an expert block is one unit, gathered whole. The
  planner saw the blocks the model's structure makes leaves, not those the config's
  ``zero.leaf_modules`` names: for such a block it planned one unit per expert, and its bound on
  what is gathered at once was half what the engine gathered.

In 16-bit training at stages 2-3 the engine's gradient shards are fp32 accumulators: the planner
counts their (4 - p) bytes per element beyond its gradient column as workspace, so they are
added to the gradient column here (as test_planner_measure.py does).
"""

from __future__ import annotations

import pytest
import torch
from gloo_world import run_ranks
from torch import nn

WORLD = 2
WIDTH, RANK_R, LAYERS = 96, 4, 4
EXPERTS = 4
ZERO = {"reduce_bucket_size": 20_000, "allgather_bucket_size": 20_000, "param_persistence_threshold": 0}


class Adapted(nn.Module):
    """A frozen Linear with a trainable low-rank update beside it (LoRA's shape)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(WIDTH, RANK_R, bias=False)
        self.lora_b = nn.Linear(RANK_R, WIDTH, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.lora_b(self.lora_a(x)))


class AdapterNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Adapted() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, 3)  # trained whole

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class MoE(nn.Module):
    """Top-1 routing over EXPERTS experts: a leaf by structure (Note [expert blocks])."""

    CONTAINER = "experts"

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        setattr(self, self.CONTAINER, nn.ModuleList(Expert() for _ in range(EXPERTS)))

    def forward(self, x):
        choice = self.router(x).argmax(dim=-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(getattr(self, self.CONTAINER)):
            rows = choice == index
            if rows.any():
                out[rows] = expert(x[rows])
        return x + out


class Mixture(MoE):
    """The same block with its experts under a name that does not say so: a leaf only because the
    config's zero.leaf_modules names its class."""

    CONTAINER = "ffns"


class MoENet(nn.Module):
    BLOCK: type[MoE] = MoE

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.moes = nn.ModuleList(self.BLOCK() for _ in range(2))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        x = self.inp(x)
        for moe in self.moes:
            x = moe(x)
        return self.head(x).square().mean()


class MixtureNet(MoENet):
    BLOCK = Mixture


MODELS = {"adapters": AdapterNet, "moe": MoENet, "moe-by-config": MixtureNet}
LEAVES = {"moe-by-config": ["Mixture"]}  # zero.leaf_modules
RUNS = [(model, stage, precision) for model in MODELS for precision in ("fp32", "bf16") for stage in (0, 1, 2, 3)]


def planned(model: str, stage: int, precision: str) -> dict:
    """The planner's columns for this model, world, stage and precision (pure, on the meta device)."""
    from zerorun.planner.counting import count_module
    from zerorun.planner.memory import Job, Training, estimate, stage3_unit_sizes

    with torch.device("meta"):
        spec = count_module(MODELS[model](), model)
    leaves = {"leaf_modules": tuple(LEAVES[model])} if model in LEAVES else {}
    training = Training(stage=stage, precision=precision, device="cpu", **leaves, **ZERO)
    est = estimate(spec, Job(WORLD), training)
    return {"parameters": est.params, "gradients": est.grads, "optimizer_state": est.optimizer,
            "gathered": stage3_unit_sizes(spec, training)[0] if stage == 3 else 0}


class MostGathered:
    """Elements of partitioned units gathered at once, at worst, over every gather of the engine's
    trained and frozen records while ``on`` (test_sharding_runtime.py watches the same way)."""

    def __init__(self, engine):
        from zerorun.zero.unit.storage import FlatUnit, ParamState

        self.units = [r.unit for r in engine.records + engine.frozen_records if r.unit.partitioned]
        self.most, self.on, self._original, self._sharded = 0, False, FlatUnit.gather, ParamState.SHARDED
        watch = self

        def gather(unit, group):
            if watch.on:
                alive = sum(u.layout.numel for u in watch.units if u.state is not watch._sharded)
                watch.most = max(watch.most, alive + (unit.layout.numel if unit.state is watch._sharded else 0))
            watch._original(unit, group)

        FlatUnit.gather = gather  # type: ignore[method-assign]

    def close(self) -> None:
        from zerorun.zero.unit.storage import FlatUnit

        FlatUnit.gather = self._original  # type: ignore[method-assign]


def measure(rank: int) -> dict:
    import zerorun

    torch.set_num_threads(1)
    found = {}
    for model_name, stage, precision in RUNS:
        torch.manual_seed(0)
        model = MODELS[model_name]()
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        zero = {"stage": stage, "leaf_modules": LEAVES.get(model_name, []), **ZERO}
        engine = zerorun.initialize(model, optimizer, {"zero": zero, "precision": {"dtype": precision}})
        watch = MostGathered(engine)
        try:
            for step in range(2):
                watch.on = step > 0  # the first forward records the order the prefetch follows
                x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(10 * step + rank))
                engine.backward(engine(x.to(torch.float32 if precision == "fp32" else torch.bfloat16)))
                if step == 0:
                    engine.step()
        finally:
            watch.close()
        found[f"{model_name}-{stage}-{precision}"] = dict(engine.memory_breakdown(), most_gathered=watch.most)
        engine.step()
    return found


@pytest.fixture(scope="module")
def breakdowns(tmp_path_factory) -> dict:
    return run_ranks(measure, WORLD, tmp_path_factory.mktemp("planner_frozen_leaf"))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model, stage, precision", RUNS, ids=[f"{m}-s{s}-{p}" for m, s, p in RUNS])
def test_model_state_matches_the_engine(breakdowns, model, stage, precision):
    plan = planned(model, stage, precision)
    if precision != "fp32" and stage >= 2:
        plan["gradients"] *= 4 / 2  # fp32 accumulators: (4 - p) bytes in the planner's workspace
    for rank in range(WORLD):
        got = breakdowns[rank][f"{model}-{stage}-{precision}"]
        for family in ("parameters", "gradients", "optimizer_state"):
            print(f"{model} stage {stage} {precision} rank {rank} {family}: engine {got[family]:,} "
                  f"planner {plan[family]:,.0f}")
            assert got[family] == pytest.approx(plan[family], rel=0.05), (
                f"{model} stage {stage} {precision} rank {rank} {family}: engine {got[family]:,} bytes, "
                f"planner {plan[family]:,.0f}")
        if stage == 3:  # what the engine gathered at once, within the planner's bound and near it
            print(f"{model} {precision} rank {rank}: gathered at once {got['most_gathered']:,} elements, "
                  f"planner bound {plan['gathered']:,}")
            assert 0.5 * plan["gathered"] <= got["most_gathered"] <= plan["gathered"]
