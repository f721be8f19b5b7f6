"""pytest tests/unit/test_ds_params.py — DeepSpeed's ds_* attributes on a unit's parameters
(zerorun/deepspeed/ds_params.py), without a process group: a unit is built for rank 1 of 2."""

from __future__ import annotations

import torch
from torch import nn

from zerorun.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from zerorun.deepspeed import ds_params
from zerorun.zero.unit.storage import FlatUnit, ParamState


def test_attributes_carry_deepspeeds_meanings():
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(3, 5)), nn.Parameter(torch.randn(7))  # 22 elements: chunks of 16
    values = torch.cat([a.detach().reshape(-1), b.detach()]).clone()
    unit = FlatUnit(0, 0, [("a", a), ("b", b)], 2, 1, partition_params=True, alignment=8)
    whole = FlatUnit(1, 0, [("c", nn.Parameter(torch.ones(4)))], 2, 1, partition_params=False)
    ds_params.attach([unit, whole])
    assert a.ds_id != b.ds_id and a.ds_numel == 15 and a.ds_shape == (3, 5) and b.ds_shape == (7,)
    # rank 1 holds elements 16..31 of the flat unit: b's elements 1..6 (a ends at 15)
    assert a.ds_tensor.numel() == 0
    assert torch.equal(b.ds_tensor, values[16:22])
    assert a.ds_status is ZeroParamStatus.NOT_AVAILABLE and not a.ds_persist
    c = whole.params[0]
    assert c.ds_status is ZeroParamStatus.AVAILABLE and c.ds_persist
    # the status follows the unit's state (a gather without a group: moved by hand here)
    unit.state = ParamState.SHARDED
    unit._move(ParamState.GATHERING)
    assert b.ds_status is ZeroParamStatus.INFLIGHT
    unit._move(ParamState.GATHERED)
    assert b.ds_status is ZeroParamStatus.AVAILABLE
