"""zerorun --nproc 2 --config zerorun.yaml train.py [--steps 40]

A minimal zerorun training script: a small MLP learns a fixed random linear map from synthetic
data, so it runs anywhere (CPU or GPU) with nothing to download. Replace the model and the data
with yours; the three engine calls in the loop stay the same.

Also runs without the launcher (one process, world size 1):  python train.py

It resumes: with ``--resume`` (or ``checkpoint.resume: true``, as job.sbatch sets it) it continues
from the last checkpoint to ``--steps`` in total on the data the uninterrupted run would take.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import zerorun
from zerorun.config import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps to train")
    args = parser.parse_args()

    # Read before initialize only for the seed and the optimizer: no world size yet (srun python
    # sets no WORLD_SIZE), so the batch sizes are checked by initialize, which knows the world.
    launched = "ZERORUN_CONFIG" in os.environ
    if launched:
        # The launcher validated the config (file, environment, flags) and hands every rank the
        # result; environ={} because the environment is already applied in it.
        config = load_config(os.environ["ZERORUN_CONFIG"], environ={})
    else:
        config = load_config("zerorun.yaml")
    torch.manual_seed(config.seed or 0)  # the same initial weights on every rank
    # Built on the CPU: the engine moves it to this worker's device (the CPU under --nproc, its GPU
    # under --gpus, torchrun or srun on a GPU node), and engine.device says which.
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    # The optimizer comes from the config's optimizer section (type, lr, weight decay) when it
    # has one, and under the launcher the engine reads the launcher's config itself (config=None):
    # one source for both, so nothing in zerorun.yaml is silently overridden. Without a config,
    # plain AdamW.
    optimizer = None if config.optimizer is not None else torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = zerorun.initialize(model, optimizer, None if launched else "zerorun.yaml")
    device = engine.device

    # The final config, its batch sizes derived with the real world size.
    micro_batch = engine.config.batch.micro_batch_size or 4
    accumulation = engine.config.gradient_accumulation_steps
    # Scaled so targets have unit variance: the loss starts near 1 and visibly falls.
    target_map = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)) / 32**0.5
    engine.set_total_steps(args.steps)  # the launcher's dashboard shows a progress bar and ETA

    # Resumable: --steps is the total. With --resume (or checkpoint.resume) initialize() loaded
    # the latest checkpoint and engine.global_step is its step, so the loop continues from there,
    # and each batch is a function of (step, micro-step, rank): a resumed run takes exactly the
    # data the uninterrupted run would have. With a real dataset, keep its position instead:
    # save it in client_state (engine.save_checkpoint(..., client_state={"seen": n})) or derive
    # it from the step, as here.
    first_step, started = engine.global_step, time.perf_counter()
    while engine.global_step < args.steps:
        step = engine.global_step
        for micro in range(accumulation):
            index = (step * accumulation + micro) * engine.world_size + engine.rank
            data = torch.Generator().manual_seed(1000 + index)
            inputs = torch.randn(micro_batch, 32, generator=data)
            targets = inputs @ target_map
            outputs = engine(inputs.to(device))
            loss = torch.nn.functional.mse_loss(outputs.float(), targets.to(device))
            engine.backward(loss)
            if micro == accumulation - 1 and engine.rank == 0:
                # Before the step() that ends the window: with checkpoint.on_signal the worker
                # saves and stops inside it.
                print(f"step {step + 1}/{args.steps}  loss {loss.item():.4f}  "
                      f"{eta(step - first_step, args.steps - step, time.perf_counter() - started)}", flush=True)
            engine.step()


def eta(done: int, left: int, elapsed_s: float) -> str:
    """'eta 0:01:05' from the steps this run has done so far (nothing to go on before the first)."""
    if done <= 0:
        return "eta -"
    seconds = round(elapsed_s / done * left)
    return f"eta {seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"

if __name__ == "__main__":
    main()
