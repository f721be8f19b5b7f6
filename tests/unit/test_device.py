"""pytest tests/unit/test_device.py — the device contract (Note [device contract] in zerorun/worker/device.py)."""

from __future__ import annotations

import sys
import types

from zerorun.launch.device import device_for_worker
from zerorun.worker.device import worker_device
from zerorun.launch.plan import Target, build_plan
from zerorun.telemetry import recorder


def test_worker_device_reads_the_launchers_decision_and_nothing_else():
    assert worker_device({"ZERORUN_DEVICE": "cpu"}) == "cpu"
    assert worker_device({"ZERORUN_DEVICE": "cuda:3"}) == "cuda:3"
    for junk in ("", "gpu", "cuda", "cuda:-1", "cuda:01", "cpu; rm -rf /", "cuda:99999"):
        assert worker_device({"ZERORUN_DEVICE": junk}) == "auto"
    assert worker_device({}) == "auto"
    assert [device_for_worker(kind, 2) for kind in ("cpu", "cuda", None)] == ["cpu", "cuda:2", None]


def test_plan_gives_each_worker_its_device():
    def plan(kind):
        return build_plan({"a": [0, 1], "b": [0, 1]}, Target(script="t.py"), python="py", cwd="/w", run_dir="/r",
                          token="t", master_port=1234, device_kind=kind)

    assert [w.env["ZERORUN_DEVICE"] for w in plan("cpu").workers] == ["cpu"] * 4
    assert [w.env["ZERORUN_DEVICE"] for w in plan("cuda").workers] == ["cuda:0", "cuda:1"] * 2
    assert all("ZERORUN_DEVICE" not in w.env for w in plan(None).workers)


class _Tripwire(types.SimpleNamespace):
    def __getattr__(self, name):
        raise AssertionError(f"torch.cuda.{name} touched by a CPU worker")


def test_recorder_of_a_cpu_worker_never_touches_cuda(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=_Tripwire()))
    monkeypatch.setenv("ZERORUN_DEVICE", "cpu")
    assert recorder._device_info({"ZERORUN_DEVICE": "cpu"})["device"] == "cpu"
    assert "cuda_allocated" not in recorder.sample_memory()


def test_recorder_on_a_gpu_the_worker_does_not_have_says_cpu_instead_of_crashing(monkeypatch):
    """Two workers on a one-GPU machine; rank 1 asked for device 1 and died."""

    def properties(index):
        if index >= 1:
            raise AssertionError("Invalid device id")
        return types.SimpleNamespace(total_memory=80 << 30)

    cuda = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: False, device_count=lambda: 1,
                                 get_device_properties=properties)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert recorder._device_info({"LOCAL_RANK": "1"})["device"] == "cpu"
    told = recorder._device_info({"ZERORUN_DEVICE": "cuda:0", "LOCAL_RANK": "1"})
    assert (told["device"], told["device_total_bytes"]) == ("cuda:0", 80 << 30)
