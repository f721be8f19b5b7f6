"""pytest tests/unit/test_record_parts.py — a record's gradient, gathering and update parts.

Each part (zerorun/zero/unit/parts.py) moves only through its own transitions and refuses the
others with an InternalError, and only its owning module changes it: grad_reduce.py the
gradient, param_gather.py the gathering, update.py the update (checked on the source).
"""

from __future__ import annotations

import ast
import inspect
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import zerorun
from zerorun.errors import InternalError, UsageError
from zerorun.zero.unit.parts import GatheringPart, GradientPart, GradState, UpdatePart

PACKAGE = Path(zerorun.__file__).parent


# -- gradient ------------------------------------------------------------------------------
def test_a_gradient_goes_round_one_backward():
    part = GradientPart(index=3)
    bucket = torch.zeros(4)
    part.hold_bucket(bucket, None, [False, False])
    assert part.arrive(needed=2) is False and part.state is GradState.FILLING
    part.mark_written(1)
    assert part.arrive(needed=2) is True and part.state is GradState.READY
    assert part.start_reduce(torch.float32) is None  # no chunk yet (lazy): a fresh output
    handed, written, buffer = part.hand_over_bucket()
    assert handed is bucket and written == [False, True] and buffer is None
    assert part.bucket is None and part.written is None
    part.finish_reduce(torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    assert part.state is GradState.IDLE and part.arrived == 0
    assert part.chunk is not None and part.chunk.dtype == torch.float32  # the first contribution
    assert part.nbytes() == 2 * 4


def test_a_later_contribution_adds_into_the_chunk_once():
    part = GradientPart(index=0)
    part.start_window(torch.zeros(2))
    for out_is_chunk, expected in ((True, [0.0, 0.0]), (False, [1.0, 1.0])):
        part.close_arrivals()
        into = part.start_reduce(torch.float32)
        # Only the window's first reduce may write straight into the accumulator.
        assert (into is part.chunk) == out_is_chunk
        assert part.chunk is not None
        part.finish_reduce(part.chunk if out_is_chunk else torch.ones(2))
        assert part.chunk.tolist() == expected


@pytest.mark.parametrize("illegal", [
    "launch before complete", "arrive while reducing", "second bucket", "finish twice",
    "drop while filling", "second full buffer", "close while reducing", "hand over while filling",
    "written without bucket",
])
def test_a_gradient_refuses_a_transition_its_owner_never_makes(illegal):
    part = GradientPart(index=5)
    reducing = GradientPart(index=5)
    reducing.close_arrivals()
    reducing.start_reduce(torch.float32)
    steps = {
        "launch before complete": lambda: part.start_reduce(torch.float32),
        "arrive while reducing": lambda: reducing.arrive(needed=1),
        "second bucket": lambda: [part.hold_bucket(torch.zeros(1), None, [False]) for _ in range(2)],
        "finish twice": lambda: [reducing.finish_reduce(None) for _ in range(2)],
        "drop while filling": lambda: (part.arrive(needed=2), part.drop()),
        "second full buffer": lambda: [part.hold_full(torch.zeros(2), torch.zeros(1)) for _ in range(2)],
        "close while reducing": reducing.close_arrivals,
        "hand over while filling": lambda: (part.arrive(needed=2), part.hand_over_bucket()),
        "written without bucket": lambda: part.mark_written(0),
    }
    with pytest.raises(InternalError, match="unit 5"):
        steps[illegal]()


# -- gathering -----------------------------------------------------------------------------
def test_gathering_counts_never_go_below_zero():
    part = GatheringPart(index=2)
    part.hold()
    part.hold()
    part.let_go()
    part.let_go()
    assert part.in_use == 0
    with pytest.raises(InternalError, match="unit 2: let go by a call that did not hold it"):
        part.let_go()
    part.plan(frozenset({1, 4}), True)
    assert part.keep_after == {1, 4} and part.keep_for_backward


# -- update --------------------------------------------------------------------------------
def test_an_update_happens_once_per_window():
    part = UpdatePart(index=1)
    part.set_square(torch.tensor(4.0))
    part.mark_updated()
    with pytest.raises(InternalError, match="norm piece computed twice"):
        part.set_square(torch.tensor(4.0))
    with pytest.raises(InternalError, match="updated twice"):
        part.mark_updated()
    part.close_window()
    assert part.square is None and not part.updated
    part.mark_updated()  # a new window


def test_pending_work_is_collected_before_the_window_closes():
    part = UpdatePart(index=7)
    failed: Future = Future()
    part.submit(failed)
    with pytest.raises(InternalError, match="second early update"):
        part.submit(Future())
    with pytest.raises(InternalError, match="window closed with its early update pending"):
        part.close_window()
    failed.set_exception(ValueError("worker failed"))
    with pytest.raises(ValueError, match="worker failed"):
        part.collect()  # the worker's error reaches the main thread
    healthy = UpdatePart(index=8)
    done: Future = Future()
    done.set_result(None)
    healthy.submit(done)
    healthy.collect()
    healthy.close_window()


INPUTS = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))


def _two_backwards_then_step(offload: str) -> list[torch.Tensor]:
    from zerorun.zero.engine import initialize

    model = _model()
    engine = initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        {"zero": {"stage": 2, "offload_optimizer": {"device": offload}}})
    for _ in range(2):
        engine.backward(engine(INPUTS).sum())
    engine.step()
    return [p.detach() for p in model.parameters()]


def test_a_second_boundary_backward_is_refused_where_the_first_already_updated():
    """With an offloaded optimizer a unit updates as soon as its gradient is final in the
    boundary backward (Note [update while backward runs] in update.py), so a second backward
    before step() would step it twice: one clear line instead. Beside the model nothing
    updates before step(), and two backwards simply add up."""
    reference = _model()
    (2 * reference(INPUTS).sum()).backward()  # the two backwards' gradients, summed
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    for got, expected in zip(_two_backwards_then_step("none"), reference.parameters(), strict=True):
        torch.testing.assert_close(got, expected.detach(), rtol=0, atol=1e-6)
    with pytest.raises(UsageError, match=r"engine.backward\(\) ran twice at one accumulation boundary"):
        _two_backwards_then_step("cpu")


# -- ownership -----------------------------------------------------------------------------
OWNERS = {"gradient": ("zero/grad_reduce.py", GradientPart), "gathering": ("zero/param_gather.py", GatheringPart),
          "update": ("zero/update.py", UpdatePart)}
READERS = {"nbytes"}  # methods that change nothing


def _changes(path: Path) -> list[tuple[str, str]]:
    """(part, what) for every call of a part's changing method and every assignment to a
    part's field in ``path``: ``x.gradient.arrive(...)``, ``x.update.square = ...``, also
    through a local name (``gradient = record.gradient; gradient.drop()``)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {node.targets[0].id: node.value.attr for node in ast.walk(tree)
               if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
               and isinstance(node.value, ast.Attribute) and node.value.attr in OWNERS}
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            targets = [(node.func, True)]
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = [(t, False) for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
        for target, called in targets:
            if not isinstance(target, ast.Attribute):
                continue
            holder = target.value
            part = (holder.attr if isinstance(holder, ast.Attribute)
                    else aliases.get(holder.id) if isinstance(holder, ast.Name) else None)
            if part in OWNERS and (not called or target.attr in _changing_methods(OWNERS[part][1])):
                found.append((part, f"{path.relative_to(PACKAGE)}:{node.lineno} {target.attr}"))
    return found


def _changing_methods(cls) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_") and name not in READERS}


def test_each_part_is_changed_by_its_owner_alone():
    changes = [change for path in sorted(PACKAGE.rglob("*.py")) for change in _changes(path)]
    by_owner = {part: [what for p, what in changes if p == part] for part in OWNERS}
    for part, (owner, _) in OWNERS.items():
        assert any(what.startswith(owner) for what in by_owner[part])  # the scan sees the owner's calls
        assert [what for what in by_owner[part] if not what.startswith(owner)] == []
