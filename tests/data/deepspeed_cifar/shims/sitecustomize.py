"""Seed and loss recorder for the cifar parity runs, for tests only (Python imports
``sitecustomize`` from PYTHONPATH at start-up).

The example builds its network with torch's default generator, whose seed torch 2.13 draws
afresh in every process; with CIFAR_TORCH_SEED=N every worker seeds it with N first, so the
DeepSpeed run and the zerorun run start from the same weights (neither import draws from it).

The example prints its losses with three decimals, too coarse for a 1e-4 comparison. With
CIFAR_LOSS_LOG=PREFIX set, every worker process (one with RANK set: not the launcher) appends the
full-precision value of each ``nn.CrossEntropyLoss`` call to PREFIX.rank{RANK}, one per line, the
same way under DeepSpeed and under zerorun. The example itself is not touched.
"""

import os

if os.environ.get("CIFAR_TORCH_SEED") and os.environ.get("RANK") is not None:
    import torch

    torch.manual_seed(int(os.environ["CIFAR_TORCH_SEED"]))

if os.environ.get("CIFAR_LOSS_LOG") and os.environ.get("RANK") is not None:
    import torch.nn

    _forward = torch.nn.CrossEntropyLoss.forward
    _path = f"{os.environ['CIFAR_LOSS_LOG']}.rank{os.environ['RANK']}"

    def _recording_forward(self, input, target):
        loss = _forward(self, input, target)
        with open(_path, "a") as log:
            log.write(f"{float(loss.detach().float())!r}\n")
        return loss

    torch.nn.CrossEntropyLoss.forward = _recording_forward
