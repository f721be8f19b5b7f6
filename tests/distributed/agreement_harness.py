"""Shared pieces of tests/distributed/test_collective_agreement.py and test_uneven_inputs.py (and
their forked ranks): a tiny model whose "branches" run only for the rows routed to them (as
experts do), its batches, a plain-torch reference, and a world runner that records what each
rank saw, including the error that ended it.

Every module with parameters is its own unit (``allgather_bucket_size: 1``), as the blocks and
experts of a real model are.
"""

from __future__ import annotations

import faulthandler
import os
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gloo_world import end_rank_now, run_ranks

WORLD = 2
WIDTH = 6
BRANCHES = 3
ROWS = 4  # per rank and batch
LR = 0.05
CONFIG = {"zero": {"stage": 3, "allgather_bucket_size": 1, "reduce_bucket_size": 1}, "gradient_clipping": 0.0}
RANK_DEADLINE_S = 240  # a rank still running then is stuck (today's main hangs): it ends with its stacks


class Branchy(nn.Module):
    """Each row goes to the branch its first feature names (an integer 0..BRANCHES-1); a branch
    no row picked is not called at all, as an expert no token reached."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.branches = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(BRANCHES))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        choice = x[:, 0].long()
        h = torch.tanh(self.embed(x))
        out = torch.zeros_like(h)
        for index, branch in enumerate(self.branches):
            picked = choice == index
            if bool(picked.any()):
                out = out.index_put((picked.nonzero().squeeze(-1),), branch(h[picked]))
        return F.mse_loss(self.head(h + out).squeeze(-1), y)


def build_model() -> Branchy:
    torch.manual_seed(7)
    return Branchy()


def batch(seed: int, branches: tuple[int, ...] = tuple(range(BRANCHES))) -> tuple[torch.Tensor, torch.Tensor]:
    """ROWS rows routed, in turn, to ``branches``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, WIDTH, generator=gen)
    x[:, 0] = torch.tensor([branches[i % len(branches)] for i in range(ROWS)], dtype=torch.float32)
    return x, torch.randn(ROWS, generator=gen)


def train_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(1000 + 10 * step + rank)


def eval_batch(index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(5000 + 10 * index + rank)


class Reference:
    """Plain torch on the same global batch: each rank's loss on its micro-batch, the mean of
    them backpropagated (what data parallelism averages), SGD."""

    def __init__(self):
        self.model = build_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR)

    def train_step(self, step: int) -> list[float]:
        losses = [self.model(*train_batch(step, rank)) for rank in range(WORLD)]
        self.optimizer.zero_grad()
        (sum(losses) / WORLD).backward()
        self.optimizer.step()
        return [loss.item() for loss in losses]

    @torch.no_grad()
    def eval_loss(self, index: int, rank: int) -> float:
        return self.model(*eval_batch(index, rank)).item()


def engine_for(model: nn.Module):
    from zerorun.zero.engine import initialize

    return initialize(model, torch.optim.SGD(model.parameters(), lr=LR), dict(CONFIG))


def record(seen: dict, key: str, value) -> None:
    seen.setdefault(key, []).append(value)


def train_on(engine, inputs: tuple, seen: dict) -> None:
    """One training step on ``inputs``, its loss recorded under "train"."""
    loss = engine(*inputs)
    record(seen, "train", loss.item())
    engine.backward(loss)
    engine.step()


def _rank(rank: int, body_name: str, module_name: str) -> dict:
    import importlib

    faulthandler.dump_traceback_later(RANK_DEADLINE_S, exit=True)  # a hang ends the rank, with its stacks
    torch.set_num_threads(1)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    body = getattr(importlib.import_module(module_name), body_name)
    seen: dict = {"rank": rank}
    try:
        body(rank, seen)
    except Exception as err:
        seen["error"] = {"type": type(err).__name__, "message": str(err),
                         "hint": getattr(err, "hint", None), "at": time.monotonic(),
                         "traceback": traceback.format_exc()[-3000:]}
        # The world is broken, as a script's would be after the error: the rank ends here.
        end_rank_now(seen)
    return seen


def run_world(tmp: Path, body_name: str, module_name: str) -> dict[int, dict]:
    """Run ``module_name.body_name(rank, seen)`` on WORLD forked ranks; every rank's ``seen``."""
    return run_ranks(_rank, WORLD, tmp, body_name, module_name)
