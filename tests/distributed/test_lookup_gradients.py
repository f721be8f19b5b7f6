"""pytest tests/distributed/test_lookup_gradients.py — a tied embedding's lookup gradient sent as
rows (Note [lookup gradients] in zerorun/zero/lookup_gradients.py) trains as the dense path does.

Two gloo ranks, stage 3, every block and MLP its own unit, 3 steps, ``tied_embedding_rows``
off and on, on:
- the tiny GPT of examples/gpt.py (a head tied to the token embedding), fp32 with 2 micro-steps of
  gradient accumulation and clipping (the updates start while backward runs), bf16 with every
  block recomputed, and fp32 with a prefetch budget and clipping (the step gathers the next
  forward's first units, the tied one first);
- a tiny tied model whose embedding has a padding token, present in the batch, its lookup
  reading rows and (more than half the table looked up) gathering.
Every lookup reads its rows instead of the gathered table (Note [lookup rows first] in
zerorun/zero/lookup_rows.py), or gathers where its rows are most of the table; the first loss is
bit-equal to the dense path's.
Losses and final weights match the dense path's within summation-order error (TOLERANCE below),
every backward exchanges rows once, the tied unit's dense
reduce-scatter is the first of each backward (the head's share, where before it was the last),
and the rows sent are fewer bytes than that dense reduce-scatter.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from gloo_world import run_ranks
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

# (loss relative, weight absolute): in fp32 summation order alone (measured: losses equal to 1e-7,
# weights within 8.2e-7); in bf16 the losses are bf16 numbers, 2^-8 apart relative, and sums
# taken in another order round apart by a unit there (measured: the third step's loss 6.0625
# against 6.125, two units; weights within 0.0039, one unit at 1.0): two units of each.
TOLERANCE = {"fp32": (1e-5, 1e-5), "bf16": (2.0**-6, 2.0**-7)}
CASES = {
    "fp32+accumulation+clip": ({"gradient_clipping": 0.5}, 2),
    "bf16+recompute": ({"precision": {"dtype": "bf16"},
                        "activation_checkpointing": {"enabled": True, "modules": ["Block"]}}, 1),
    # the link bench's setting: a prefetch budget, so the step issues the next forward's first
    # gathers, the tied unit's among them (Note [next forward's gathers in the step])
    "fp32+prefetch+clip": ({"gradient_clipping": 0.5, "zero": {"prefetch_bucket_size": 20000}}, 1),
}


class PaddedTied(nn.Module):
    """An embedding with a padding token, tied to the head, around two linear layers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(48, 16, padding_idx=0)
        self.hidden = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 48, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens, targets):
        logits = self.head(self.hidden(self.embed(tokens)))
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Collectives:
    """The collectives this rank issued: (op, unit index, bytes)."""

    def __init__(self):
        self.issued: list[tuple[str, int, int]] = []
        self.unit_of: dict[int, int] = {}

    def collective_started(self, seq, op, nbytes):
        self.issued.append((op, seq, nbytes))

    def collective_finished(self, *args):
        pass

    def collective_waited(self, *args):
        pass

    def collective_sent(self, *args):
        pass


def train(rank: int, model_name: str, extra: dict, accumulation: int, sparse: bool, rows_fraction: float | None = None) -> dict:
    import zerorun
    from gpt import GPT, preset, rank_slice, synthetic_batch
    from zerorun.zero.comm import collectives
    from zerorun.zero.unit.storage import ParamState

    torch.manual_seed(0)
    cfg = preset("tiny")
    model = GPT(cfg) if model_name == "gpt" else PaddedTied()
    zero = {"stage": 3, "param_persistence_threshold": 0, "tied_embedding_rows": sparse, **extra.get("zero", {})}
    config = {**extra, "zero": zero, "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": accumulation}}
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    tied = next(r for r in engine.records if any(p is model.head.weight for p in r.unit.params))
    rows_first = engine.gatherer.rows_first
    assert (rows_first is not None) == sparse
    if rows_first is not None and rows_fraction is not None:
        rows_first.fraction = rows_fraction
    seen = Collectives()
    reduced_units: list[list[int]] = []
    original = collectives.reduce_scatter

    def reduce_scatter(output, input, **kwargs):
        reduced_units[-1].append(kwargs.get("unit", (0, -1))[1])
        return original(output, input, **kwargs)

    collectives.reduce_scatter = reduce_scatter
    collectives.add_observer(seen)
    losses, in_flight = [], []
    try:
        for step in range(3):
            for micro in range(accumulation):
                if model_name == "gpt":
                    tokens, targets = synthetic_batch(cfg, 4, step=step * accumulation + micro)
                    tokens, targets = rank_slice(tokens, rank, 2), rank_slice(targets, rank, 2)
                else:
                    generator = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
                    tokens = torch.randint(0, 48, (2, 12), generator=generator)
                    tokens[:, -3:] = 0  # padding
                    targets = torch.randint(1, 48, (2, 12), generator=generator)
                loss = engine(tokens, targets)
                reduced_units.append([])
                engine.backward(loss)
                engine.step()
                losses.append(loss.float().item())
                in_flight.append(tied.unit.state is ParamState.GATHERING)
    finally:
        collectives.reduce_scatter = original
        collectives.remove_observer(seen)
    state = engine.full_state_dict(rank0_only=False)
    rows = [nbytes for op, _, nbytes in seen.issued if op == "lookup_rows"]
    return {"losses": losses, "in_flight": in_flight, "state": {k: v.float() for k, v in state.items()}, "tied": tied.index,
            "first_reduced": [units[0] for units in reduced_units], "last_reduced": [units[-1] for units in reduced_units],
            "rows_read": [rows_first.served, rows_first.gathered] if rows_first is not None else None,
            "rows_sent": rows, "tied_dense_bytes": tied.unit.layout.padded_numel * tied.unit.dtype.itemsize // 2}


def compared(dense: dict, rows: dict) -> dict:
    """Both runs' figures, the weights as each tensor's largest difference."""
    difference = {key: (rows["state"][key] - value).abs().max().item() for key, value in dense["state"].items()}
    strip = lambda run: {k: v for k, v in run.items() if k != "state"}
    return {"dense": strip(dense), "rows": strip(rows), "weights": difference}


def all_cases(rank: int) -> dict:
    runs = {name: compared(train(rank, "gpt", extra, accumulation, False), train(rank, "gpt", extra, accumulation, True))
            for name, (extra, accumulation) in CASES.items()}
    dense = train(rank, "padded", {}, 1, False)
    # 2 x 12 tokens of 48 per rank: the union is more than half the table, so the lookup gathers
    # (Note [lookup rows first]); with the bar at the whole table it reads rows, the padding's too
    runs["padding"] = compared(dense, train(rank, "padded", {}, 1, True))
    runs["padding+rows"] = compared(dense, train(rank, "padded", {}, 1, True, rows_fraction=1.0))
    return runs


def test_lookup_rows_train_as_the_dense_gradient_does(tmp_path):
    for rank, cases in run_ranks(all_cases, 2, tmp_path).items():
        for name, runs in cases.items():
            dense, sparse = runs["dense"], runs["rows"]
            loss_tolerance, weight_tolerance = TOLERANCE["bf16" if name.startswith("bf16") else "fp32"]
            assert torch.allclose(torch.tensor(sparse["losses"]), torch.tensor(dense["losses"]), rtol=loss_tolerance), \
                (rank, name, sparse["losses"], dense["losses"])
            worst = max(runs["weights"].items(), key=lambda item: item[1])
            assert worst[1] <= weight_tolerance, (rank, name, worst)
            backwards = len(sparse["losses"])
            # the dense path reduces the tied unit last in every backward; the rows path first, and
            # then exchanges rows once per backward, in fewer bytes than the dense reduce-scatter
            assert dense["last_reduced"] == [dense["tied"]] * backwards, (rank, name, dense["last_reduced"])
            assert sparse["first_reduced"] == [sparse["tied"]] * backwards, (rank, name, sparse["first_reduced"])
            assert len(sparse["rows_sent"]) == backwards and dense["rows_sent"] == [], (rank, name)
            assert 0 < max(sparse["rows_sent"]) < sparse["tied_dense_bytes"], (rank, name, sparse["rows_sent"])
            # every forward's lookup read rows (Note [lookup rows first]), bit-equal to the gathered
            # table's: the first loss, before any update, is the dense run's to the bit
            expected_rows = [0, backwards] if name == "padding" else [backwards, 0]
            assert sparse["rows_read"] == expected_rows, (rank, name, sparse["rows_read"])
            assert sparse["losses"][0] == dense["losses"][0], (rank, name)
            # with a budget the step leaves the tied unit's gather in flight for the next forward
            # (from the second step: the first forward records the order), unless that forward's
            # first call reads rows: then the rows go first and the gather at the head
            assert dense["in_flight"][1:] == [name.endswith("prefetch+clip")] * (backwards - 1), (rank, name, dense)
            assert sparse["in_flight"] == [False] * backwards, (rank, name, sparse)
