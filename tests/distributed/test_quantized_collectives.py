"""pytest tests/distributed/test_quantized_collectives.py — ZeRO++'s quantized collectives
(Note [quantized collectives] in zerorun/zero/comm/quantized_collectives.py) on gloo ranks.

- The quantized all-gather hands every rank the same tensor: each rank's part read back from its
  int8 blocks, bit for bit what quantize.pack/unpack make of it; the reduce-scatter's result is
  within its stated bound of the exact sum (the sum over the other ranks of half their block's
  scale, plus fp32 rounding); both report the packed bytes they moved; at 2 ranks (the host
  channel) and 3 (the ring over gloo, ZERORUN_HOST_CHANNEL=0).
- Training at stage 3 with qwZ and qgZ changes the weights forward sees, never the masters: a
  checkpoint saved with them on loads with them off into the same full state, and that state
  is not on the int8 grid (the rounded copies were not written back). With
  quantized_nontrainable_weights only the units of frozen parameters gather quantized.
- ``-m long``: 200 steps of the demo GPT (examples/gpt.py "tiny", 2 ranks, stage 3) with qwZ,
  qgZ and both: the mean loss of the last 20 steps within 2% of the same run without them
  (docs/benchmarks.md derives the bound).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from gloo_world import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

N = 5003  # elements per rank: odd, several blocks of 256 and a short last one
BLOCK = 256


class Bytes:
    def __init__(self):
        self.ops: list[tuple[str, int]] = []

    def collective_started(self, seq, op, nbytes):
        pass

    def collective_finished(self, seq, op, nbytes, seconds, waited):
        self.ops.append((op, nbytes))


def quantized_pair(rank: int, world: int, channel: str) -> dict:
    import torch.distributed as dist

    from zerorun.zero.comm import collectives, quantize, quantized_collectives

    os.environ["ZERORUN_HOST_CHANNEL"] = channel  # read when the group's channel would open
    inputs = [torch.randn(N * world, generator=torch.Generator().manual_seed(7 + r)) * (r + 1) for r in range(world)]
    bytes_seen = Bytes()
    collectives.add_observer(bytes_seen)
    # all-gather: rank r contributes inputs[r][:N]
    gathered = torch.empty(N * world)
    quantized_collectives.quantized_all_gather(gathered, inputs[rank][:N], group=None, block=BLOCK)
    expected = torch.cat([quantize.unpack(quantize.pack(inputs[r][:N], BLOCK, torch.empty(
        quantize.packed_nbytes(N, BLOCK), dtype=torch.uint8)), BLOCK, torch.empty(N)) for r in range(world)])
    # reduce-scatter: the exact sum of everyone's chunk ``rank``, and the bound
    out = torch.empty(N)
    quantized_collectives.quantized_reduce_scatter(out, inputs[rank], group=None, block=BLOCK, async_op=True).wait()
    mine = slice(rank * N, (rank + 1) * N)
    exact = sum(inputs[r][mine].double() for r in range(world))
    bound = sum(quantize.max_error(inputs[r][mine], BLOCK).double() for r in range(world) if r != rank)
    slack = world * torch.finfo(torch.float32).eps * sum(inputs[r][mine].abs().double() for r in range(world))
    err = (out.double() - exact).abs()
    result = {"gather_exact": bool(torch.equal(gathered, expected)),
              "gather_rounded": bool((gathered != torch.cat([inputs[r][:N] for r in range(world)])).any()),
              "rs_within": bool((err <= bound + slack).all()), "rs_max_err": float(err.max()),
              "rs_max_bound": float(bound.max()), "ops": bytes_seen.ops}
    dist.destroy_process_group()
    return result


@pytest.mark.parametrize(("world", "channel"), [(2, "1"), (3, "0")])
def test_quantized_collectives(tmp_path, world, channel):
    from zerorun.zero.comm import quantize

    results = run_ranks(quantized_pair, world, tmp_path, world, channel, leave_together=False)
    part = quantize.packed_nbytes(N, BLOCK)
    for rank, r in results.items():
        assert r["gather_exact"] and r["gather_rounded"], rank
        assert r["rs_within"], (rank, r["rs_max_err"], r["rs_max_bound"])
        assert 0 < r["rs_max_err"] <= r["rs_max_bound"] * 1.001
        assert r["ops"] == [["all_gather", part * world], ["reduce_scatter_q", part * (world - 1)]]
    assert part < N * 4 / 3.9  # about a quarter of fp32's bytes


# --- training ------------------------------------------------------------------------------------

def train(rank: int, world: int, zero: dict, steps: int, lr: float = 1e-3, save: str | None = None):
    import zerorun
    from gpt import GPT, preset, rank_slice, synthetic_batch

    cfg = preset("tiny")
    torch.manual_seed(0)
    model = GPT(cfg)
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr),
                                {"zero": {"stage": 3, **zero}, "batch": {"micro_batch_size": 4}})
    losses = []
    for step in range(steps):
        tokens, targets = synthetic_batch(cfg, 4 * world, step=step)
        loss = engine(rank_slice(tokens, rank, world), rank_slice(targets, rank, world))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if save:
        engine.save_checkpoint(save, tag="t")
    return engine, losses


def checkpoint_masters(rank: int, out_dir: str) -> dict:
    import torch.distributed as dist

    from zerorun.zero.comm import quantize

    quantized = {"quantized_weights": True, "quantized_gradients": True, "quantization_block_size": 64}
    engine, _ = train(rank, 2, quantized, steps=4, save=str(Path(out_dir, "ckpt")))
    saved = engine.full_state_dict(rank0_only=False)
    fresh, _ = train(rank, 2, {}, steps=0)
    fresh.load_checkpoint(str(Path(out_dir, "ckpt")), tag="t")
    loaded = fresh.full_state_dict(rank0_only=False)
    same = all(torch.equal(saved[k], loaded[k]) for k in saved)
    off_grid = 0
    for value in saved.values():
        flat = value.reshape(-1).float()
        packed = torch.empty(quantize.packed_nbytes(flat.numel(), 64), dtype=torch.uint8)
        off_grid += int((quantize.unpack(quantize.pack(flat, 64, packed), 64, torch.empty_like(flat)) != flat).sum())
    dist.destroy_process_group()
    return {"same": same, "off_grid": off_grid}


def test_checkpoint_holds_exact_masters(tmp_path):
    results = run_ranks(checkpoint_masters, 2, tmp_path, str(tmp_path), leave_together=False)
    for rank, r in results.items():
        assert r["same"], rank
        assert r["off_grid"] > 1000, r  # the tiny GPT's 1.5M masters are not the rounded copies


def quantize_blocks(rank: int) -> dict:
    import torch.distributed as dist

    import zerorun
    from gpt import GPT, preset

    torch.manual_seed(0)
    model = GPT(preset("nano"))
    model.blocks[0].requires_grad_(False)
    engine = zerorun.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]),
                                {"zero": {"stage": 3, "quantized_nontrainable_weights": True}})
    blocks = {"frozen": [r.unit.quantize_block for r in engine.frozen_records],
              "trained": [r.unit.quantize_block for r in engine.records]}
    dist.destroy_process_group()
    return blocks


def test_nontrainable_weights_quantize_only_frozen_units(tmp_path):
    blocks = run_ranks(quantize_blocks, 2, tmp_path, leave_together=False)[0]
    assert blocks["frozen"] and all(b == 2048 for b in blocks["frozen"]), blocks
    assert blocks["trained"] and all(b is None for b in blocks["trained"]), blocks


def losses_per_variant(rank: int) -> dict:
    import torch.distributed as dist

    runs = {"none": {}, "qwz": {"quantized_weights": True}, "qgz": {"quantized_gradients": True},
            "both": {"quantized_weights": True, "quantized_gradients": True}}
    losses = {name: train(rank, 2, zero, steps=200)[1] for name, zero in runs.items()}
    dist.destroy_process_group()
    return losses


@pytest.mark.long
def test_quantized_training_converges_like_exact(tmp_path):
    losses = run_ranks(losses_per_variant, 2, tmp_path, leave_together=False)[0]
    (tmp_path.parent / "quantized_losses.json").write_text(json.dumps(losses))
    def tail(name):
        return sum(losses[name][-20:]) / 20
    assert losses["none"][-1] < losses["none"][0] * 0.5  # it learned something
    for name in ("qwz", "qgz", "both"):
        assert abs(tail(name) - tail("none")) <= 0.02 * tail("none"), (name, tail(name), tail("none"))
