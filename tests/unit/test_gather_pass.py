"""pytest tests/unit/test_gather_pass.py — stage 3's pass state (Note [pass state] in zero/gather_pass.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from zerorun.errors import InternalError
from zerorun.zero.gather_pass import PassState, PassTracker, in_backward


def test_forward_then_backward_then_idle():
    passes = PassTracker()
    passes.move(PassState.FORWARD)
    assert passes.enter_call() is False  # a forward call outside autograd's engine
    passes.move(PassState.BACKWARD)
    passes.move(PassState.IDLE)
    assert passes.state is PassState.IDLE


def test_illegal_moves_are_refused():
    passes = PassTracker()
    passes.move(PassState.FORWARD)
    with pytest.raises(InternalError, match="FORWARD -> RECOMPUTE"):
        passes.move(PassState.RECOMPUTE)
    passes.move(PassState.BACKWARD)
    passes.move(PassState.RECOMPUTE)
    with pytest.raises(InternalError, match="RECOMPUTE -> IDLE"):
        passes.move(PassState.IDLE)
    with pytest.raises(InternalError, match="RECOMPUTE -> FORWARD"):
        passes.move(PassState.FORWARD)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_recomputation_is_seen_from_inside_backward(reentrant):
    """A module call under torch.utils.checkpoint's recomputation (either kind) enters
    RECOMPUTE and leaves back to BACKWARD; the forward's own calls do not."""
    passes = PassTracker()
    seen = []
    layer = torch.nn.Linear(3, 3)

    def pre(module, args):
        seen.append(("pre", passes.enter_call(), in_backward()))

    def post(module, args, output):
        passes.leave_call(passes.recomputing)
        seen.append(("post", passes.state))

    layer.register_forward_pre_hook(pre)
    layer.register_forward_hook(post, always_call=True)  # torch stops a recomputation early by raising
    x = torch.randn(2, 3, requires_grad=True)
    passes.move(PassState.FORWARD)
    out = checkpoint(layer, x, use_reentrant=reentrant)
    passes.move(PassState.BACKWARD)
    out.sum().backward()
    assert seen == [("pre", False, False), ("post", PassState.FORWARD),
                    ("pre", True, True), ("post", PassState.BACKWARD)]


def test_nested_recomputations_count_depth():
    passes = PassTracker()
    passes.move(PassState.BACKWARD)
    passes.move(PassState.RECOMPUTE)
    passes.depth = 1
    passes.state = PassState.RECOMPUTE
    assert passes.enter_call() is True and passes.depth == 2
    passes.leave_call(True)
    assert passes.state is PassState.RECOMPUTE
    passes.leave_call(True)
    assert passes.state is PassState.BACKWARD
    with pytest.raises(InternalError, match="recomputing call ended"):
        passes.leave_call(True)
