"""Shared pieces of the checkpoint tests (imported by tests/distributed/test_checkpoint*.py and
by their spawned ranks): a model with dropout, a buffer, tied and frozen weights; the cases;
a training loop that records losses and RNG draws; and a spawner of small gloo worlds.

Every world is spawned with a ``file://`` rendezvous; each rank writes ``rank{R}.pt`` with
``torch.save`` (losses as Python floats, parameters as tensors), read back by the test.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zero_parity_harness as parity

from zerorun.zero.comm.process_group import leaving_together

VOCAB, WIDTH, NARROW = 17, 15, 7
STEPS, HALF = 10, 5


class DropNet(nn.Module):
    """Odd sizes, a tied head, a frozen layer, dropout (the RNG must resume) and a buffer that
    training changes (it must resume too)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.inner = nn.Linear(WIDTH, NARROW)
        self.outer = nn.Linear(NARROW, WIDTH)
        self.drop = nn.Dropout(0.25)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, tokens, targets):
        if self.training:
            self.seen += 1
        h = self.embed(tokens)
        h = h + self.outer(self.drop(torch.tanh(self.inner(h))))
        h = h + 0.5 * self.frozen(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def build_dropnet() -> DropNet:
    torch.manual_seed(4321)
    return DropNet()


@dataclass(frozen=True)
class ResumeCase:
    name: str
    stage: int
    zero: dict = field(default_factory=dict)
    accumulation: int = 1
    clipping: float = 0.0

    def config(self) -> dict:
        return {
            "zero": {"stage": self.stage, "reduce_bucket_size": 200, "param_persistence_threshold": 40,
                     "allgather_bucket_size": 100, **self.zero},
            "batch": {"gradient_accumulation_steps": self.accumulation},
            "gradient_clipping": self.clipping,
            "scheduler": {"type": "StepLR", "params": {"step_size": 3, "gamma": 0.7}},
        }


def nvme(tmp: str) -> dict:
    return {"device": "nvme", "nvme_path": str(Path(tmp) / "nvme"), "buffer_count": 3, "buffer_size": 1000}


def resume_cases(tmp: str) -> list[ResumeCase]:
    cpu = {"offload_optimizer": {"device": "cpu"}}
    cases = [ResumeCase(f"s{s}", s) for s in range(4)]
    cases += [ResumeCase(f"s{s}+cpu", s, cpu) for s in (1, 2, 3)]
    cases += [ResumeCase("s2+nvme-accum-clip", 2, {"offload_optimizer": nvme(tmp)}, accumulation=2, clipping=0.3),
              ResumeCase("s3-accum-clip", 3, accumulation=2, clipping=0.3)]
    return cases


ROWS = 4  # rows per rank per micro-step


def dropnet_batch(step: int, micro: int, rank: int):
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return (torch.randint(0, VOCAB, (ROWS, 6), generator=gen), torch.randint(0, VOCAB, (ROWS, 6), generator=gen))


def optimizer_for(model: nn.Module):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2, betas=(0.9, 0.95))


def run_steps(engine, case: ResumeCase, rank: int, steps: range) -> dict:
    """Train ``steps``; per step the loss (rank 0 sees its own), a python and a numpy draw."""
    losses, draws = [], []
    for step in steps:
        window = 0.0
        for micro in range(case.accumulation):
            loss = engine(*dropnet_batch(step, micro, rank))
            engine.backward(loss)
            engine.step()
            window += float(loss.detach())
        losses.append(window)
        draws.append((random.random(), float(numpy.random.rand())))
    return {"losses": losses, "draws": draws}


def seed_rank(rank: int) -> None:
    torch.manual_seed(77 + rank)
    random.seed(88 + rank)
    numpy.random.seed(99 + rank)


def resume_first_world(rank: int, world: int, tmp: str) -> dict:
    """Per case: 10 steps straight, then a fresh engine's first 5 steps and a save."""
    import zerorun

    results = {}
    for case in resume_cases(tmp):
        model = build_dropnet()
        seed_rank(rank)
        engine = zerorun.initialize(model, optimizer_for(model), case.config())
        straight = run_steps(engine, case, rank, range(STEPS))
        straight["final"] = engine.full_state_dict()
        model = build_dropnet()
        seed_rank(rank)
        engine = zerorun.initialize(model, optimizer_for(model), case.config())
        first = run_steps(engine, case, rank, range(HALF))
        engine.save_checkpoint(Path(tmp) / case.name, client_state={"case": case.name, "next_step": HALF})
        results[case.name] = {"straight": straight, "first": first}
    return results


def resume_second_world(rank: int, world: int, tmp: str) -> dict:
    """Per case: a fresh engine (other seeds) loads the checkpoint and runs the last 5 steps."""
    import zerorun

    results = {}
    for case in resume_cases(tmp):
        model = build_dropnet()
        seed_rank(rank + 1000)  # whatever the process did before must not matter
        engine = zerorun.initialize(model, optimizer_for(model), case.config())
        path, client = engine.load_checkpoint(Path(tmp) / case.name)
        second = run_steps(engine, case, rank, range(HALF, STEPS))
        second["final"] = engine.full_state_dict()
        second["client"] = client
        second["global_step"] = engine.global_step
        second["lr"] = engine.get_lr()
        results[case.name] = second
    return results


# -- resharding: the parity model, every world on the same global batch ---------------------
@dataclass(frozen=True)
class ReshardCase:
    """Saved from ``source`` at world 2, loaded into ``target`` at another world or stage."""

    name: str
    source: parity.Case
    target: parity.Case


def reshard_sources(tmp: str) -> list[parity.Case]:
    return [
        parity.Case("s1-adamw", 1),
        parity.Case("s3-adamw+cpu", 3, extra={"zero": {"offload_optimizer": {"device": "cpu"}}}),
        parity.Case("s2-sgd-accum-clip", 2, "sgd", accumulation=2, clipping=0.3),
    ]


def reshard_loads(tmp: str, world: int) -> list[tuple[str, parity.Case]]:
    """(saved case name, the case it is loaded into) for a world of ``world`` ranks."""
    cpu = {"offload_optimizer": {"device": "cpu"}}
    if world == 3:
        return [("s1-adamw", parity.Case("s1-adamw", 1)),
                ("s1-adamw", parity.Case("s1-adamw", 3)),
                ("s3-adamw+cpu", parity.Case("s3-adamw+cpu", 2)),
                ("s2-sgd-accum-clip", parity.Case("s2-sgd-accum-clip", 3, "sgd", accumulation=2, clipping=0.3,
                                                  extra={"zero": {"offload_optimizer": nvme(tmp)}}))]
    return [("s1-adamw", parity.Case("s1-adamw", 0)),
            ("s3-adamw+cpu", parity.Case("s3-adamw+cpu", 1, extra={"zero": cpu})),
            ("s2-sgd-accum-clip", parity.Case("s2-sgd-accum-clip", 2, "sgd", accumulation=1, clipping=0.3))]


def train_parity(engine, case: parity.Case, rank: int, world: int, steps: range) -> list[float]:
    """The parity harness's loop over ``steps`` of the global batch: mean loss per step."""
    return [parity.train_step(engine, case, rank, world, step) for step in steps]


def reshard_save_world(rank: int, world: int, tmp: str) -> dict:
    import zerorun

    results = {}
    for case in reshard_sources(tmp):
        model = parity.build_model()
        engine = zerorun.initialize(model, parity.build_optimizer(model, case.optimizer), case.config())
        results[case.name] = train_parity(engine, case, rank, world, range(HALF))
        engine.save_checkpoint(Path(tmp) / case.name)
    return results


def reshard_load_world(rank: int, world: int, tmp: str) -> dict:
    import zerorun

    results = {}
    for saved, case in reshard_loads(tmp, world):
        model = parity.build_model()
        engine = zerorun.initialize(model, parity.build_optimizer(model, case.optimizer), case.config())
        engine.load_checkpoint(Path(tmp) / saved)
        losses = train_parity(engine, case, rank, world, range(HALF, STEPS))
        results[f"{saved}->w{world}-s{case.stage}"] = {"losses": losses, "final": engine.full_state_dict()}
    return results


# -- spawning ---------------------------------------------------------------------------------
def _rank_entry(rank: int, body, world: int, tmp: str) -> None:
    torch.set_num_threads(1)  # 2-3 ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous-{body.__name__}", rank=rank, world_size=world)
    with leaving_together():  # Note [clean exit] in zerorun/zero/comm/process_group.py
        result = body(rank, world, tmp)
    torch.save(result, Path(tmp) / f"{body.__name__}-rank{rank}.pt")


def spawn(body, world: int, tmp: str) -> dict[int, dict]:
    """Run ``body(rank, world, tmp)`` on ``world`` gloo ranks; every rank's result."""
    from gloo_world import start_processes

    start_processes(_rank_entry, (body, world, tmp), world)
    return {r: torch.load(Path(tmp) / f"{body.__name__}-rank{r}.pt", weights_only=False) for r in range(world)}



# -- a rank killed in the middle of a save ------------------------------------------------------
def crash_world(rank: int, world: int, tmp: str) -> dict:
    """Save global_step2, record the full state, train 2 more steps, then start saving
    global_step4: rank 1 SIGKILLs itself after writing its first tensor of the new file."""
    import os
    import signal

    import zerorun
    from zerorun.zero.checkpoint import tensor_files

    model = build_dropnet()
    case = ResumeCase("crash", 3)
    engine = zerorun.initialize(model, optimizer_for(model), case.config())
    run_steps(engine, case, rank, range(2))
    engine.save_checkpoint(Path(tmp) / "ckpt")
    full = engine.full_state_dict()
    if rank == 0:
        torch.save(full, Path(tmp) / "at_step2.pt")
    run_steps(engine, case, rank, range(2, 4))
    if rank == 1:
        original = tensor_files.TensorFileWriter.write

        def write_then_die(self, key, tensor):
            original(self, key, tensor)
            self._out._handle.flush()
            (Path(tmp) / "killed").write_text(key)
            os.kill(os.getpid(), signal.SIGKILL)

        tensor_files.TensorFileWriter.write = write_then_die
    engine.save_checkpoint(Path(tmp) / "ckpt")
    return {}
