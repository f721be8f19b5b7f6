"""``deepspeed.accelerator.get_accelerator()``: the device calls DeepSpeed scripts make, for CUDA
and the CPU.

    pytest tests/unit/test_deepspeed_module.py -k accelerator

Which one: the kind of device the engine trains on, by Note [device contract] in
zerorun/worker/device.py (``DS_ACCELERATOR``, else the launcher's ``ZERORUN_DEVICE``, else an
existing group's backend, else CUDA when this process sees a GPU). The CPU accelerator talks
gloo, the CUDA one NCCL, like the engine's process group.
"""

from __future__ import annotations

import os

import torch

from zerorun.worker import device as worker_device


class CpuAccelerator:
    _name = "cpu"
    _communication_backend_name = "gloo"

    def device_name(self, device_index=None) -> str:
        return "cpu"

    def device(self, device_index=None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device_index) -> None:
        pass  # one CPU; DeepSpeed's CPU accelerator ignores it too

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK") or 0)

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE") or 1)

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def manual_seed(self, seed) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def memory_allocated(self, device_index=None) -> int:
        return 0

    def max_memory_allocated(self, device_index=None) -> int:
        return 0

    def is_synchronized_device(self) -> bool:
        return True

    def use_host_timers(self) -> bool:
        return True

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor

    def random(self):
        return torch.random


class CudaAccelerator(CpuAccelerator):
    _name = "cuda"
    _communication_backend_name = "nccl"

    def device_name(self, device_index=None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index=None) -> torch.device:
        return torch.device("cuda", device_index) if device_index is not None else torch.device("cuda")

    def set_device(self, device_index) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def synchronize(self, device_index=None) -> None:
        torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def manual_seed(self, seed) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed) -> None:
        torch.cuda.manual_seed_all(seed)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def is_synchronized_device(self) -> bool:
        return False

    def use_host_timers(self) -> bool:
        return False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def random(self):
        return torch.cuda.random


def accelerator_kind(environ=None) -> str:
    """"cuda" or "cpu": the engine's device kind (Note [device contract] in zerorun/worker/device.py),
    so a script's ``get_accelerator().device_name()`` is where the engine trains."""
    import torch.distributed as dist

    environ = os.environ if environ is None else environ
    backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else None
    return worker_device.device_kind(environ, worker_device.visible_gpus, backend)


def get_accelerator() -> CpuAccelerator:
    return CudaAccelerator() if accelerator_kind() == "cuda" else CpuAccelerator()


def set_accelerator(accelerator) -> None:
    """DeepSpeed lets a script install its own accelerator; zerorun follows the launcher's device."""
    from zerorun.deepspeed.unsupported import refuse

    raise refuse("deepspeed.accelerator.set_accelerator", "custom accelerators")
