"""pytest tests/unit/test_unit_plan.py — stage 3's choice of gather units (zero/unit/plan.py),
and the planner sizing its stage-3 buffers from the same units the engine builds."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from zerorun.zero.unit.partition import _coalesce_modules, build_partition
from zerorun.zero.unit.plan import ModuleNode, ParamNode, coalesce_units, max_gathered_numel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

TRAINABLE = lambda p: p.trainable


def leaf(name: str, *sizes: int) -> ModuleNode:
    return ModuleNode(name, True, tuple(ParamNode(f"{name}.{i}", s) for i, s in enumerate(sizes)), ())


def test_small_leaves_merge_into_their_parent_until_the_minimum_is_reached():
    block = ModuleNode("b", True, (), (leaf("b.q", 30), leaf("b.k", 30), leaf("b.v", 50)))
    root = ModuleNode("", True, (), (block,))
    units = coalesce_units(root, TRAINABLE, min_numel=100)
    assert [(u.owner, u.numel) for u in units] == [("b", 110)]


def test_no_catch_all_unit_when_leftovers_overflow():
    # Eight 60-element leaves under a root, minimum 100: merging would make one 480-element
    # unit gathered for the whole forward; each leaf owns its own instead.
    root = ModuleNode("", True, (), tuple(leaf(f"l{i}", 60) for i in range(8)))
    units = coalesce_units(root, TRAINABLE, min_numel=100)
    assert sorted(u.owner for u in units) == [f"l{i}" for i in range(8)]
    assert max_gathered_numel(units) == 180  # the running leaf and the two prefetched in backward


def test_containers_pass_pieces_up_and_tied_parameters_count_once():
    tied = ParamNode("shared", 500)
    emb = ModuleNode("emb", True, (tied,), ())
    blocks = ModuleNode("blocks", False, (), (leaf("blocks.0", 40), leaf("blocks.1", 40)))
    # at the root itself the two small blocks would stay apart (Note [no catch-all unit])
    head = ModuleNode("head", True, (tied,), ())
    inner = ModuleNode("body", True, (), (emb, blocks, head))
    units = coalesce_units(ModuleNode("", True, (), (inner,)), TRAINABLE, min_numel=100)
    assert [(u.owner, u.numel) for u in units] == [("emb", 500), ("body", 80)]
    assert sum(p.key == "shared" for u in units for p in u.params) == 1


def test_nested_units_are_counted_as_gathered_together():
    block = ModuleNode("b", True, (ParamNode("b.w", 100),), (leaf("b.mlp", 200),))
    units = coalesce_units(ModuleNode("", True, (), (block,)), TRAINABLE, min_numel=100)
    depth_of = {u.owner: u.depth for u in units}
    assert depth_of["b.mlp"] == 1 and depth_of["b"] == 0
    assert max_gathered_numel(units) == 300  # fewer units than the bound: all of them


def test_frozen_and_small_parameters_are_not_eligible():
    node = ModuleNode("", True, (ParamNode("f", 1000, trainable=False), ParamNode("s", 5), ParamNode("w", 300)), ())
    units = coalesce_units(node, lambda p: p.trainable and p.numel > 10, min_numel=100)
    assert [[p.key for p in u.params] for u in units] == [["w"]]


def test_gpt_gets_one_unit_per_block_part_not_one_for_the_root():
    from gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=4096, seq_len=32, n_layer=3, n_head=4, d_model=256))
    owners = _coalesce_modules(model, persistence_threshold=10_000, min_numel=500_000)
    names = {id(m): n for n, m in model.named_modules()}
    owned = sorted(names[id(m)] for m, _ in owners)
    assert "" not in owned  # the attention layers must not pile up in a root unit
    assert owned == sorted(["tok_emb", "blocks.0", "blocks.1", "blocks.2",
                            "blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"])


def test_planner_sizes_stage3_buffers_from_the_engines_units():
    from zerorun.planner.counting import count_module
    from zerorun.planner.memory import Training, stage3_unit_sizes
    from zerorun.zero.unit.plan import STAGE3_UNIT_CAP

    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(300, 300) for _ in range(6)], nn.Linear(300, 7))

    training = Training(stage=3, precision="fp32", allgather_bucket_size=150_000, param_persistence_threshold=3000)
    with torch.device("meta"):
        spec = count_module(build(), "mlp")
    gathered, bucket, units = stage3_unit_sizes(spec, training)
    # The real partition of the same model, built at world size 1 with the same settings.
    model = build()
    optimizer = torch.optim.AdamW(model.parameters())
    partition = build_partition(model, optimizer, stage=3, world_size=1, rank=0, bucket_numel=10**8,
                                persistence_threshold=3000, min_unit_numel=min(150_000, STAGE3_UNIT_CAP))
    sharded = [u for u in partition.units if u.partitioned]
    sizes = sorted((u.layout.numel for u in sharded), reverse=True)
    # Six Linear(300, 300) units, biases with their weights; the head's unit (2,107 elements)
    # is below the threshold and stays whole (Note [persistent units]).
    assert units == len(sharded) == 6
    assert bucket == sizes[0] == 90_300
    whole = [u for u in partition.units if not u.partitioned]
    assert sum(u.layout.numel for u in whole) == 7 * 300 + 7
    assert gathered == sum(sizes[:3])  # the running unit and the two backward prefetches
