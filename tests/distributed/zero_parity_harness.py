"""Shared pieces of the parity suite (imported by tests/distributed/test_zero_parity.py and by
the spawned ranks): the awkward model, the cases, the engine loop and the reference loop.

The model is built to hit every hard case at once: odd sizes (7, 15, 17) that do not divide
by 2 or 3, an embedding tied to the output head, a frozen layer, a layer never used, a layer
called twice in one forward, a 240-element weight that needs no padding at 1-3 ranks, and two
optimizer param groups (no weight decay on biases/norms).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zerorun.zero.comm import collectives
from zerorun.zero.comm.process_group import leaving_together
from zerorun.zero.engine import initialize
from zerorun.zero.offload.placements import OnDevice, OnFile

VOCAB, WIDTH, NARROW, SEQ = 17, 15, 7, 5
GLOBAL_BATCH = 12  # sequences per optimizer step: divides by world x accumulation for 1-3 ranks
STEPS = 10
OVERFLOW_SCALE_POWER = 20


class OddNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.inner = nn.Linear(WIDTH, NARROW)
        self.outer = nn.Linear(NARROW, WIDTH)
        self.twice = nn.Linear(WIDTH, WIDTH)
        # 16 x 15 = 240 elements divide by 8 x {1, 2, 3}: a lone, unpadded unit (no-copy path).
        self.widen = nn.Linear(WIDTH, 16, bias=False)
        self.unwiden = nn.Linear(16, WIDTH, bias=False)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(WIDTH, 3)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        h = h + self.outer(torch.tanh(self.inner(h)))
        h = self.twice(torch.tanh(self.twice(h)))
        h = h + self.unwiden(torch.tanh(self.widen(h)))
        h = h + self.frozen(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def build_model() -> OddNet:
    torch.manual_seed(1234)
    return OddNet()


def build_optimizer(model: nn.Module, kind: str, lr_scale: float = 1.0):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    if kind == "adamw":
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=3e-2 * lr_scale, betas=(0.9, 0.95))
    groups = [{"params": decay, "weight_decay": 1e-3}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.05 * lr_scale}]
    return torch.optim.SGD(groups, lr=0.1 * lr_scale, momentum=0.9)


def global_batch(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    return tokens, targets


@dataclass(frozen=True)
class Case:
    name: str
    stage: int
    optimizer: str = "adamw"
    dtype: str = "fp32"
    accumulation: int = 1
    clipping: float = 0.0
    extra: dict = field(default_factory=dict)
    embeddings_on_device: bool = False  # the per-unit policy below, instead of one placement

    def config(self) -> dict:
        precision = {"dtype": self.dtype, **self.extra.get("precision", {})}
        # Small buckets and units: several collectives per step, per-module gathers.
        zero = {"stage": self.stage, "reduce_bucket_size": 200, "param_persistence_threshold": 40,
                "allgather_bucket_size": 100, **self.extra.get("zero", {})}
        for key in ("offload_optimizer", "offload_param"):
            if zero.get(key, {}).get("device") == "nvme" and "nvme_path" not in zero[key]:
                zero[key] = {**zero[key], "nvme_path": nvme_scratch()}  # Note [parity scratch]
        return {
            "zero": zero,
            "precision": precision,
            "batch": {"gradient_accumulation_steps": self.accumulation},
            "gradient_clipping": self.clipping,
        }


def cases() -> list[Case]:
    found = []
    for stage in range(4):
        found += [
            Case(f"s{stage}-adamw-fp32", stage),
            Case(f"s{stage}-sgd-accum-clip-fp32", stage, "sgd", accumulation=2, clipping=0.3),
            Case(f"s{stage}-adamw-bf16", stage, dtype="bf16"),
            # Scale 2^8: this model's fp16 gradients overflow from about 2^13, and a skipped step
            # is not parity (the overflow case below covers skipping).
            Case(f"s{stage}-adamw-fp16-accum-clip", stage, dtype="fp16", accumulation=2, clipping=0.5,
                 extra={"precision": {"initial_scale_power": 8}}),
        ]
    # Stage 3 with large units: the root module owns (gathers) every partitioned parameter.
    found.append(Case("s3-sgd-root-unit-fp32", 3, "sgd", accumulation=2, extra={"zero": {"allgather_bucket_size": 10**6}}))
    # fp16 overflow: a loss scale of 2^20 overflows fp16 gradients, so every rank must skip
    # the step and halve the scale until it fits, then train normally.
    for stage in (1, 2):  # stage 1: the overflow seen in the reduced chunks (Note [scatter in place])
        found.append(Case(f"s{stage}-fp16-overflow", stage, dtype="fp16",
                          extra={"precision": {"initial_scale_power": OVERFLOW_SCALE_POWER, "hysteresis": 1}}))
    return found + offload_cases()


CPU = {"device": "cpu"}
# Small buffers: the 15x16 / 17x15 units' master + two Adam moments need up to ~800 elements,
# so 3 buffers of 1000 make the reader wait for the writer (Note [file buffers]). No nvme_path:
# Case.config gives each test run its own (Note [parity scratch]).
NVME = {"device": "nvme", "buffer_count": 3, "buffer_size": 1000}

# Note [parity scratch]: the NVMe cases' files live in a folder of this test run's own, made by
# the first process that needs it (tempfile.mkdtemp: a new name, created atomically, so no other
# run can hold it) and passed to its ranks in SCRATCH_ENV (gloo_world's ranks take the starting
# process's environment before a case runs); the process that made it removes it at exit. It
# used to be one fixed folder under the temp directory for everyone: two runs on one machine
# (CI and a developer, two worktrees) wrote there at once, and the first to end removed the
# folder under the other (test_zero_parity's clean-up after each world).
SCRATCH_ENV = "ZERORUN_TEST_PARITY_SCRATCH"


def nvme_scratch() -> str:
    """This test run's NVMe scratch folder (Note [parity scratch])."""
    path = os.environ.get(SCRATCH_ENV)
    if not path:
        path = tempfile.mkdtemp(prefix="zerorun-parity-nvme-")
        os.environ[SCRATCH_ENV] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def clear_scratch() -> None:
    """Remove what the cases left in this run's scratch, keeping the folder (its name stays
    this run's); the folder itself goes at the exit of the process that made it."""
    root = Path(nvme_scratch())
    for entry in root.iterdir() if root.is_dir() else ():
        shutil.rmtree(entry, ignore_errors=True)


class EmbeddingsOnDevice:
    """A per-unit placement policy (``initialize(..., state_home_for=)``): the unit holding the
    (tied) embedding keeps master and optimizer state on the device, every other unit's live in
    NVMe files."""

    def __init__(self, rank: int):
        self.device = OnDevice()
        self.files = OnFile(nvme_scratch(), rank, buffer_count=NVME["buffer_count"], buffer_size=NVME["buffer_size"])

    def __call__(self, unit):
        return self.device if any(name.startswith("embed.") for name in unit.names) else self.files


def offload_cases() -> list[Case]:
    """Optimizer offload (cpu, nvme) at stages 1-3 and parameter offload (cpu, nvme) at stage 3; each has a
    twin without offload among cases() (same name less the suffix) that it must match exactly.
    With clipping the update waits for the norm; without it the worker thread updates each unit
    during backward (Note [update while backward runs] in zerorun/zero/update.py)."""
    found = []
    for stage in (1, 2, 3):
        found += [
            Case(f"s{stage}-adamw-fp32+cpu", stage, extra={"zero": {"offload_optimizer": CPU}}),
            Case(f"s{stage}-sgd-accum-clip-fp32+cpu", stage, "sgd", accumulation=2, clipping=0.3,
                 extra={"zero": {"offload_optimizer": CPU}}),
            Case(f"s{stage}-adamw-fp32+nvme", stage, extra={"zero": {"offload_optimizer": NVME}}),
            Case(f"s{stage}-sgd-accum-clip-fp32+nvme", stage, "sgd", accumulation=2, clipping=0.3,
                 extra={"zero": {"offload_optimizer": NVME}}),
        ]
    found += [
        Case("s3-adamw-fp32+cpu+params", 3, extra={"zero": {"offload_optimizer": CPU, "offload_param": CPU}}),
        Case("s3-sgd-accum-clip-fp32+cpu+params", 3, "sgd", accumulation=2, clipping=0.3,
             extra={"zero": {"offload_optimizer": CPU, "offload_param": CPU}}),
        Case("s3-adamw-fp32+nvme+params", 3, extra={"zero": {"offload_optimizer": NVME, "offload_param": NVME}}),
        Case("s3-sgd-accum-clip-fp32+nvme+params", 3, "sgd", accumulation=2, clipping=0.3,
             extra={"zero": {"offload_optimizer": NVME, "offload_param": NVME}}),
        Case("s3-adamw-fp16-accum-clip+cpu", 3, dtype="fp16", accumulation=2, clipping=0.5,
             extra={"precision": {"initial_scale_power": 8}, "zero": {"offload_optimizer": CPU}}),
        Case("s2-adamw-bf16+nvme", 2, dtype="bf16", extra={"zero": {"offload_optimizer": NVME}}),
        # Mixed homes: one optimizer call for the device's units, the files' one at a time.
        Case("s3-adamw-fp32+embed-device-rest-nvme", 3, embeddings_on_device=True),
        Case("s2-sgd-accum-clip-fp32+embed-device-rest-nvme", 2, "sgd", accumulation=2, clipping=0.3,
             embeddings_on_device=True),
    ]
    return found


class PerMicroStep:
    """An observer on zerorun/zero/comm/collectives.py: per micro-step, every collective as
    [op, bytes, bytes this rank sends], and whether the trained parameters (all but ``unused``)
    held a ``.grad`` after its backward: [any, all]."""

    def __init__(self, engine):
        self.units = [r.unit.layout.padded_numel * r.unit.full.element_size() for r in engine.records]
        self.trained = [p for n, p in engine.module.named_parameters() if p.requires_grad and not n.startswith("unused.")]
        self.micro_steps: list[list] = []
        self.grads_held: list[list[bool]] = []
        self._ops: dict[int, list] = {}

    def collective_started(self, seq, op, nbytes):
        self._ops.setdefault(seq, [op, nbytes, 0])[:2] = [op, nbytes]

    def collective_finished(self, seq, op, nbytes, seconds, waited):
        pass

    def collective_sent(self, seq, op, within, between):
        self._ops.setdefault(seq, [op, 0, 0])[2] = within + between

    def after_backward(self) -> None:
        held = [p.grad is not None for p in self.trained]
        self.grads_held.append([any(held), all(held)])

    def after_step(self) -> None:
        self.micro_steps.append([self._ops[seq] for seq in sorted(self._ops)])
        self._ops.clear()


def train_step(engine, case: Case, rank: int, world: int, step: int, observed: PerMicroStep | None = None) -> float:
    """One optimizer step on this rank's rows of the global batch; the mean loss over ranks."""
    rows_per_micro = GLOBAL_BATCH // (world * case.accumulation)
    tokens, targets = global_batch(step)
    window = torch.zeros(1)
    for micro in range(case.accumulation):
        start = (micro * world + rank) * rows_per_micro
        rows = slice(start, start + rows_per_micro)
        loss = engine(tokens[rows], targets[rows])
        engine.backward(loss)
        if observed is not None:
            observed.after_backward()
        engine.step()
        if observed is not None:
            observed.after_step()
        window += loss.detach().float()
    if world > 1:
        dist.all_reduce(window)
    return float(window) / (world * case.accumulation)


def train_engine(case: Case, rank: int, world: int) -> dict:
    """Train 10 steps on this rank's rows of each global batch; return what rank 0 reports.
    (zerorun.zero.engine.initialize: the package's own takes no placement policy.)"""
    model = build_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    homes = EmbeddingsOnDevice(rank) if case.embeddings_on_device else None
    engine = initialize(model, build_optimizer(model, case.optimizer), case.config(), state_home_for=homes)
    losses, scales, skipped = [], [], []
    observed = PerMicroStep(engine)
    collectives.add_observer(observed)
    try:
        for step in range(STEPS):
            losses.append(train_step(engine, case, rank, world, step, observed))
            scales.append(engine.loss_scale)
            skipped.append(engine.skipped_steps)
    finally:
        collectives.remove_observer(observed)
    skips = torch.tensor([engine.skipped_steps, -engine.skipped_steps])
    if world > 1:
        dist.all_reduce(skips, op=dist.ReduceOp.MAX)
    return {
        "skipped_agree": int(skips[0]) == -int(skips[1]),
        "losses": losses,
        "scales": scales,
        "skipped": skipped,
        "initial": initial,
        "final": engine.full_state_dict(rank0_only=True),
        "global_step": engine.global_step,
        "units": observed.units,
        "micro_steps": observed.micro_steps,
        "grads_held": observed.grads_held,
    }


def train_reference(case: Case, lr_scale: float = 1.0) -> dict:
    """One process, fp32, the whole global batch per step: what every world must reproduce."""
    model = build_model()
    optimizer = build_optimizer(model, case.optimizer, lr_scale)
    losses = []
    for step in range(STEPS):
        tokens, targets = global_batch(step)
        loss = model(tokens, targets)
        optimizer.zero_grad()
        loss.backward()
        for param in model.parameters():  # "unused" gets a zero gradient, as in the engine
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
        if case.clipping > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clipping)
        optimizer.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "final": {k: v.clone() for k, v in model.state_dict().items()}}


def check_collectives(rank: int, world: int) -> list[str]:
    """zerorun.zero.comm.collectives against torch's own all_reduce; returns the failures."""
    failures = []
    gen = torch.Generator().manual_seed(rank)
    for n in (1, 5, 1000):
        data = torch.randn(n * world, generator=gen)
        untouched = data.clone()
        expected = data.clone()
        dist.all_reduce(expected)
        out = torch.empty(n)
        collectives.reduce_scatter(out, data, group=None)
        if not torch.allclose(out, expected[rank * n : (rank + 1) * n], atol=1e-6):
            failures.append(f"reduce_scatter n={n}")
        if not torch.equal(data, untouched):
            failures.append(f"reduce_scatter modified its input n={n}")
        full = torch.zeros(n * world)
        full[rank * n : (rank + 1) * n] = rank + 1
        collectives.all_gather(full, full[rank * n : (rank + 1) * n], group=None, async_op=True).wait()
        if not torch.equal(full, torch.arange(1.0, world + 1).repeat_interleave(n)):
            failures.append(f"in-place all_gather n={n}")
    # Two reduce-scatters in flight at once, waited in order (what stage 2 does in backward).
    a, b = torch.ones(4 * world), torch.full((6 * world,), 2.0)
    out_a, out_b = torch.empty(4), torch.empty(6)
    handles = [collectives.reduce_scatter(out_a, a, group=None, async_op=True),
               collectives.reduce_scatter(out_b, b, group=None, async_op=True)]
    for handle in handles:
        handle.wait()
    if not (torch.equal(out_a, torch.full((4,), float(world))) and torch.equal(out_b, torch.full((6,), 2.0 * world))):
        failures.append("overlapping reduce_scatters")
    return failures


def run_world(rank: int, world: int, init_file: str, out_path: str) -> None:
    """Entry point of one spawned rank: every case in one process group."""
    torch.set_num_threads(1)  # 2-3 ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with leaving_together():  # Note [clean exit] in zerorun/zero/comm/process_group.py
        results = {"collectives": check_collectives(rank, world)}
        for case in cases():
            results[case.name] = train_engine(case, rank, world)
        if rank == 0:
            torch.save(results, out_path)
