"""pytest tests/unit/test_param_moves.py — a move of a stage-3 model to its own device, in any
spelling, is a no-op; to another device or dtype it is refused (issue 41 row 2;
zerorun/zero/param_access.py). CUDA is mocked where it is absent: the comparison is pure."""

from __future__ import annotations

import pytest
import torch

from zerorun.zero import param_access as pa

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def test_an_index_left_out_means_the_current_device():
    assert torch.device("cuda") != CUDA0  # why the comparison needs the current index
    assert pa.same_device(torch.device("cuda"), CUDA0, current=0)
    assert pa.same_device(CUDA0, torch.device("cuda"), current=0)
    assert not pa.same_device(torch.device("cuda"), CUDA0, current=1)
    assert pa.same_device(CUDA1, CUDA1, current=0) and not pa.same_device(CUDA1, CUDA0, current=1)
    assert not pa.same_device(torch.device("cpu"), CUDA0, current=0)
    assert pa.same_device(torch.device("cpu"), torch.device("cpu"), current=None)


@pytest.mark.parametrize("name,args,kwargs", [
    ("to", ("cuda",), {}), ("to", (torch.device("cuda"),), {}), ("to", ("cuda:0",), {}), ("to", (CUDA0,), {}),
    ("to", (), {"device": "cuda"}), ("to", (torch.float32,), {}), ("to", ("cuda", torch.float32), {}),
    ("cuda", (), {}), ("cuda", (0,), {}), ("cuda", ("cuda:0",), {}), ("cuda", (), {"device": 0}),
])
def test_every_spelling_of_the_models_own_gpu_stays(name, args, kwargs):
    target = pa.move_target(name, (torch.empty(0), *args), kwargs)
    assert pa.stays(target, CUDA0, torch.float32, current=0), (name, args, kwargs, target)


@pytest.mark.parametrize("name,args", [("to", ("cuda:1",)), ("cuda", (1,)), ("cpu", ()), ("to", ("cpu",)),
                                       ("to", (torch.float16,)), ("to", ("cuda", torch.bfloat16))])
def test_a_move_elsewhere_does_not_stay(name, args):
    target = pa.move_target(name, (torch.empty(0), *args), {})
    assert not pa.stays(target, CUDA0, torch.float32, current=0)


def test_a_cpu_model_stays_on_the_cpu():
    for name, args in [("to", ("cpu",)), ("to", (torch.device("cpu"),)), ("cpu", ()), ("to", (torch.float32,))]:
        assert pa.stays(pa.move_target(name, (torch.empty(0), *args), {}), torch.device("cpu"), torch.float32, None)
    assert not pa.stays(pa.move_target("cuda", (torch.empty(0),), {}), torch.device("cpu"), torch.float32, None)


def test_the_current_index_comes_from_torch_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert pa.current_index("cuda") == 3 and pa.current_index("cpu") is None


def test_the_refusal_is_one_line_naming_both_places():
    error = pa.move_refusal(torch.empty(0), (CUDA1, None))
    assert "\n" not in str(error) and "on cpu in float32 and cannot move to cuda:1 after initialize" in str(error)
    assert "before zerorun.initialize" in error.hint
