"""zerorun --nproc 2 --config zerorun.yaml train.py [--steps 40]

A minimal zerorun training script: a small MLP learns a fixed random linear map from synthetic
data, so it runs anywhere (CPU or GPU) with nothing to download. Replace the model and the data
with yours; the three engine calls in the loop stay the same.

Also runs without the launcher (one process, world size 1):  python train.py
"""

from __future__ import annotations

import argparse
import os

import torch

import zerorun
from zerorun.config import load_config
from zerorun.launch.device import worker_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps to train")
    args = parser.parse_args()

    # Before initialize only for reading the config; the engine knows the real world (srun too).
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    launched = "ZERORUN_CONFIG" in os.environ
    if launched:
        # The launcher validated the config (file, environment, flags) and hands every rank the
        # result; environ={} because the environment is already applied in it.
        config = load_config(os.environ["ZERORUN_CONFIG"], world_size=world_size, environ={})
    else:
        config = load_config("zerorun.yaml", world_size=world_size)
    torch.manual_seed(config.seed or 0)  # the same initial weights on every rank
    # The launcher decides each worker's device (ZERORUN_DEVICE: cpu for --nproc, cuda:N for
    # --gpus); run by hand, the first GPU per local rank if there is one.
    device = worker_device(os.environ)
    if device == "auto":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device)
    # The optimizer comes from the config's optimizer section (type, lr, weight decay) when it
    # has one, and under the launcher the engine reads the launcher's config itself (config=None):
    # one source for both, so nothing in zerorun.yaml is silently overridden. Without a config,
    # plain AdamW.
    optimizer = None if config.optimizer is not None else torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = zerorun.initialize(model, optimizer, None if launched else config)

    micro_batch = config.batch.micro_batch_size or 4
    # Scaled so targets have unit variance: the loss starts near 1 and visibly falls.
    target_map = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)) / 32**0.5
    data = torch.Generator().manual_seed(1000 + engine.rank)  # each rank sees its own slice of data

    for step in range(args.steps):
        for _ in range(config.gradient_accumulation_steps):
            inputs = torch.randn(micro_batch, 32, generator=data)
            targets = inputs @ target_map
            outputs = engine(inputs.to(device))
            loss = torch.nn.functional.mse_loss(outputs.float(), targets.to(device))
            engine.backward(loss)
            engine.step()
        if engine.rank == 0:
            print(f"step {step + 1}/{args.steps}  loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
