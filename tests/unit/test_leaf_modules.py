"""pytest tests/unit/test_leaf_modules.py — expert blocks gathered as one unit (Note [expert blocks]
in zero/unit/leaf.py, Note [leaf units] in zero/unit/plan.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch import nn

from zerorun.deepspeed import utils as ds_utils
from zerorun.errors import RuntimeConfigError
from zerorun.zero.unit.leaf import check_leaf_names, is_leaf, looks_like_expert_block
from zerorun.zero.unit.partition import module_tree
from zerorun.zero.unit.plan import stage3_units

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from zoo_plain_moe import PlainMoe, PlainMoeLayer


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Linear(4, 4)


def test_expert_blocks_are_found_from_their_structure():
    model = PlainMoe(16)
    assert [type(m).__name__ for m in model.modules() if looks_like_expert_block(m)] == ["PlainMoeLayer"] * 2
    assert not looks_like_expert_block(model)  # its ``layers`` are not experts
    assert not looks_like_expert_block(Block())
    one = nn.Module()
    one.experts = nn.ModuleList([nn.Linear(2, 2)])  # a single expert is no choice among experts
    assert not looks_like_expert_block(one)


def test_a_leaf_is_one_unit_even_with_every_module_its_own():
    """``allgather_bucket_size: 1`` makes every module with parameters a unit; the expert
    block's router and experts are one unit owned by the block."""
    model = PlainMoe(16)
    units = stage3_units(module_tree(model), 0, 1)
    owners = sorted(u.owner for u in units)
    assert owners == ["embed", "head", "layers.0", "layers.1"]
    layer = dict(model.named_modules())["layers.0"]
    assert len(next(u for u in units if u.owner == "layers.0").params) == len(list(layer.parameters()))


def test_set_z3_leaf_modules_and_the_config_names():
    model = nn.Sequential(Block(), Block())
    assert sorted(u.owner for u in stage3_units(module_tree(model), 0, 1)) == ["0.attn", "0.mlp", "1.attn", "1.mlp"]
    marked = ds_utils.set_z3_leaf_modules(model, [Block])
    assert marked == list(model) and ds_utils.get_z3_leaf_modules(model) == marked
    assert ds_utils.z3_leaf_module(model[0]) and is_leaf(model[0])
    assert sorted(u.owner for u in stage3_units(module_tree(model), 0, 1)) == ["0", "1"]
    ds_utils.unset_z3_leaf_modules(model, [Block])
    assert ds_utils.get_z3_leaf_modules(model) == []
    assert sorted(u.owner for u in stage3_units(module_tree(model, frozenset({"Block"})), 0, 1)) == ["0", "1"]
    assert check_leaf_names(model, ["Block"]) == {"Block"}


def test_a_leaf_that_matches_nothing_is_refused_in_one_line():
    model = nn.Sequential(Block())
    with pytest.raises(RuntimeConfigError, match="no module of the model is a PlainMoeLayer"):
        ds_utils.set_z3_leaf_modules(model, [PlainMoeLayer])
    assert ds_utils.set_z3_leaf_modules(model, [PlainMoeLayer], raise_if_not_found=False) == []
    with pytest.raises(RuntimeConfigError, match="zero.leaf_modules names Blok"):
        check_leaf_names(model, ["Blok"])
    with pytest.raises(RuntimeConfigError, match="list of module classes"):
        ds_utils.set_z3_leaf_modules(model, [model[0]])
