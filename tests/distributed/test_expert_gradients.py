"""pytest tests/distributed/test_expert_gradients.py — an expert block's gradient completes at the
same point of backward on every rank (Note [expert gradients] in zerorun/zero/grad_reduce.py).

Two gloo ranks, stage 3 with every module its own unit; the model's middle block holds its
experts in a ``ModuleList`` named ``experts``, so it is one leaf unit (Note [expert blocks]).
Rank 0's rows all pick expert 0, rank 1's every expert. Before the fix the block's unit was
complete when its last gradient arrived: on rank 1 inside the block's backward, on rank 0
(whose idle experts get no gradient) only at the end, so rank 0 all-gathered the next unit for
backward while rank 1 reduce-scattered the block's (CollectiveMismatch, as Switch Transformers
did in the zoo's fine set). Now both ranks train 3 steps with plain torch's losses (1e-5
relative, what only summation order moves).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from agreement_harness import LR, WORLD, record, run_world, train_on

WIDTH, ROWS, EXPERTS, STEPS = 6, 4, 3, 3


class Experts(nn.Module):
    """Each row goes to the expert its first feature names; an expert no row picked is not run."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS))

    def forward(self, h, choice):
        x = self.norm(h)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().squeeze(-1)
            if rows.numel():
                out = out.index_put((rows,), expert(x[rows]))
        return h + out


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        # Gathered again in backward after the block's, more than the backward prefetch reaches.
        self.before = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())))
        self.block = Experts()
        self.after = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        choice = x[:, 0].long()
        h = torch.tanh(self.before(torch.tanh(self.embed(x))))
        h = self.block(h, choice)
        return F.mse_loss(self.head(torch.tanh(self.after(h))).squeeze(-1), y)


def build() -> Model:
    torch.manual_seed(3)
    return Model()


def rank_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's rows all pick expert 0 (the others idle there); rank 1's pick each in turn."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(ROWS, WIDTH, generator=gen)
    x[:, 0] = 0.0 if rank == 0 else torch.arange(ROWS, dtype=torch.float32) % EXPERTS
    return x, torch.randn(ROWS, generator=gen)


def train(rank: int, seen: dict) -> None:
    from zerorun.zero.engine import initialize

    model = build()
    config = {"zero": {"stage": 3, "allgather_bucket_size": 1, "reduce_bucket_size": 1,
                       "param_persistence_threshold": 0}, "gradient_clipping": 0.0}
    engine = initialize(model, torch.optim.SGD(model.parameters(), lr=LR), config)
    record(seen, "units", len(engine.records))
    for step in range(STEPS):
        train_on(engine, rank_batch(step, rank), seen)


def reference() -> list[list[float]]:
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        losses = [model(*rank_batch(step, rank)) for rank in range(WORLD)]
        optimizer.zero_grad()
        (sum(losses) / WORLD).backward()
        optimizer.step()
        out.append([loss.item() for loss in losses])
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_idle_experts_on_one_rank_train_like_plain_torch(tmp_path):
    results = run_world(tmp_path, "train", __name__)
    expected = reference()
    for rank, seen in results.items():
        assert "error" not in seen, seen["error"]["message"]
        assert seen["units"] == [8]  # embed, 4 before, the block (one leaf unit), after, head
        assert seen["train"] == pytest.approx([step[rank] for step in expected], rel=1e-5), rank
