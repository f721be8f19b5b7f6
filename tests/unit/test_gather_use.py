"""pytest tests/unit/test_gather_use.py — the rule that picks which module call gathers a unit
whose parameters are used outside its owner's call (zerorun/zero/gather_use.py)."""

from __future__ import annotations

import torch
from torch import nn

from zerorun.zero.gather_use import CallObserver, common_caller


def test_common_caller_is_the_innermost_call_shared_by_every_use():
    # OPT: the root calls model.decoder directly; embed_tokens and final_layer_norm run inside it.
    assert common_caller([("root", "decoder", "embed_tokens"), ("root", "decoder", "final_norm")]) == "decoder"
    assert common_caller([("root", "decoder", "embed")]) == "embed"  # one use: the holder itself
    assert common_caller([("root", "a"), ("root",)]) == "root"
    assert common_caller([("encoder",), ("decoder",)]) is None  # no call enclosed both uses
    assert common_caller([]) is None


def test_observer_sees_calls_of_its_model_only_and_stops():
    inner = nn.Linear(2, 2)
    outer = nn.Sequential(inner)
    other = nn.Linear(2, 2)
    observer = CallObserver(outer)
    seen = []
    inner.register_forward_pre_hook(lambda module, args: seen.append(observer.stack()))
    other.register_forward_pre_hook(lambda module, args: seen.append(observer.stack()))
    observer.start()
    outer(torch.ones(1, 2))
    other(torch.ones(1, 2))
    assert seen == [(outer, inner), ()]
    assert observer.active
    observer.stop()
    outer(torch.ones(1, 2))
    assert seen[-1] == () and not observer.active
