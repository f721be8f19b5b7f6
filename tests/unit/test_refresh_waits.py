"""pytest tests/unit/test_refresh_waits.py — the waits of Note [refresh on first read]
(zerorun/zero/refresh_ahead.py), with stand-in units whose all-gathers are counted, no process
group: which reads wait for which unit, in which order, and which pass."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from zerorun.zero.refresh_ahead import EagerRefresh, RefreshAhead, RefreshingParameter


class FakeHandle:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(self.name)


class FakeUnit:
    def __init__(self, log: list, name: str, *params: nn.Parameter):
        self.log, self.name, self.params = log, name, list(params)

    def start_refresh(self, group):
        self.log.append(f"issue {self.name}")
        return FakeHandle(self.log, self.name)


def two_units(log: list):
    first, second = nn.Parameter(torch.ones(3)), nn.Parameter(torch.full((2, 2), 2.0))
    third = nn.Parameter(torch.zeros(4))
    # Built in backward's order: the unit the forward reads first is the last.
    return [FakeUnit(log, "late", second, third), FakeUnit(log, "early", first)], (first, second, third)


def test_step_issues_in_forward_order_and_returns_without_waiting():
    log: list = []
    units, params = two_units(log)
    refresh = RefreshAhead(nn.Linear(1, 1))
    refresh.start(units, group=None)
    assert log == ["issue early", "issue late"]
    assert all(type(p) is RefreshingParameter for p in params)
    assert refresh.in_flight() == 2


def test_a_read_waits_for_its_own_unit_only_and_makes_it_plain():
    log: list = []
    units, (first, second, third) = two_units(log)
    refresh = RefreshAhead(nn.Linear(1, 1))
    refresh.start(units, group=None)
    log.clear()
    assert torch.equal(second * 2, torch.full((2, 2), 4.0))
    assert log == ["late"]
    assert type(second) is nn.Parameter and type(third) is nn.Parameter  # the whole unit
    assert type(first) is RefreshingParameter and refresh.in_flight() == 1
    second.sum()
    assert log == ["late"]  # waited once


@pytest.mark.parametrize("read", [
    lambda p: p.data, lambda p: p.detach(), lambda p: p.expand(2, 3), lambda p: p[0], lambda p: p.clone(),
    lambda p: torch.nn.functional.linear(torch.ones(1, 3), p.view(1, 3)),
    lambda p: pickle.dumps(p), lambda p: copy.deepcopy(p),
])
def test_every_kind_of_read_waits(read):
    log: list = []
    units, (first, _, _) = two_units(log)
    refresh = RefreshAhead(nn.Linear(1, 1))  # held, as the engine holds it: one that goes away makes its parameters plain
    refresh.start(units, group=None)
    log.clear()
    read(first)
    assert log == ["early"]


def test_metadata_passes_without_waiting():
    log: list = []
    units, (first, _, _) = two_units(log)
    refresh = RefreshAhead(nn.Linear(1, 1))  # held, as the engine holds it: one that goes away makes its parameters plain
    refresh.start(units, group=None)
    log.clear()
    assert (first.shape, first.dtype, first.device, first.requires_grad, first.grad) == (
        torch.Size([3]), torch.float32, torch.device("cpu"), True, None)
    assert first.numel() == 3 and first.dim() == 1
    assert log == [] and type(first) is RefreshingParameter


def test_settle_waits_for_the_rest_in_issue_order_and_a_new_step_settles_first():
    log: list = []
    units, params = two_units(log)
    refresh = RefreshAhead(nn.Linear(1, 1))
    refresh.start(units, group=None)
    refresh.start(units, group=None)  # a second step with nothing read in between
    assert log == ["issue early", "issue late", "early", "late", "issue early", "issue late"]
    refresh.settle()
    assert log[-2:] == ["early", "late"] and refresh.in_flight() == 0
    assert all(type(p) is nn.Parameter for p in params)


def test_a_users_parameter_subclass_keeps_its_class_and_is_waited_in_step():
    class Tagged(nn.Parameter):
        pass

    log: list = []
    tagged = Tagged(torch.ones(2))
    refresh = RefreshAhead(nn.Linear(1, 1))
    refresh.start([FakeUnit(log, "own", tagged)], group=None)
    assert log == ["issue own", "own"] and type(tagged) is Tagged and refresh.in_flight() == 0


def test_eager_refresh_waits_inside_step():
    log: list = []
    units, params = two_units(log)
    EagerRefresh().start(units, group=None)
    assert log == ["issue late", "issue early", "late", "early"]
    assert all(type(p) is nn.Parameter for p in params)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own imports (torch.jit)
@pytest.mark.parametrize("how", ["wrapped", "in place", "a block"])
def test_a_compiled_model_is_refreshed_inside_step(how):
    """Dynamo would trace the waits (Note [refresh on first read]): a compiled model, or one with a
    compiled block, gets plain parameters back from ``step()``."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    if how == "wrapped":
        model = torch.compile(model)
    elif how == "in place":
        model.compile()
    else:
        model[1].compile()
    log: list = []
    units, params = two_units(log)
    refresh = RefreshAhead(model)
    refresh.start(units, group=None)
    assert log == ["issue late", "issue early", "late", "early"]
    assert all(type(p) is nn.Parameter for p in params) and refresh.in_flight() == 0


def test_a_unit_of_one_rank_has_nothing_in_flight():
    from zerorun.zero.comm import collectives

    class OneRank(FakeUnit):
        def start_refresh(self, group):
            return collectives.DONE

    param = nn.Parameter(torch.ones(2))
    refresh = RefreshAhead(nn.Linear(1, 1))
    refresh.start([OneRank([], "alone", param)], group=None)
    assert type(param) is nn.Parameter and refresh.in_flight() == 0
