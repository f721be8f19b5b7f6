"""zerorun slurm_train.py STEPS OUT_DIR [SECONDS_PER_STEP [first-start]]   (or srun python slurm_train.py ...)

The tiny training job of the Slurm tests (test_slurm_jobs.py): ZeRO-2 on a 7->15->3 MLP, the same
initial weights on every rank and each rank's batch a function of (rank, step) only, so a run
resumed from a checkpoint sees exactly the batches the uninterrupted run saw. Rank 0 writes
OUT_DIR/losses.json (the global mean loss of every step it ran) and OUT_DIR/world.json (what
world it found itself in, on which node each rank ran, and a digest of the final parameters'
bytes); every rank writes OUT_DIR/pid.RANK first, so a test can watch the workers. With
``first-start`` the pause after each step applies only to a job's first start (SLURM_RESTART_COUNT
unset or 0): a start is slow enough for Slurm's timer to reach it, a requeued one quick.
"""

import hashlib
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

import zerorun


def main() -> None:
    steps, out = int(sys.argv[1]), sys.argv[2]
    pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    if sys.argv[4:] == ["first-start"] and os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
        pause = 0.0
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 15), torch.nn.Tanh(), torch.nn.Linear(15, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = os.environ.get("ZERORUN_CONFIG") or {"zero": {"stage": 2}}
    engine = zerorun.initialize(model, optimizer, config)
    rank, world = engine.rank, engine.world_size
    with open(os.path.join(out, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    nodes = [None] * world
    if world > 1:
        dist.all_gather_object(nodes, node)
    else:
        nodes = [node]
    target = torch.randn(7, 3, generator=torch.Generator().manual_seed(1))
    losses = {}
    path = os.path.join(out, "losses.json")
    if os.path.exists(path):
        losses = json.load(open(path))
    while engine.global_step < steps:
        data = torch.Generator().manual_seed(1000 * rank + engine.global_step)
        x = torch.randn(4, 7, generator=data)
        loss = torch.nn.functional.mse_loss(engine(x), x @ target)
        engine.backward(loss)
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        if rank == 0:  # before engine.step(): with checkpoint.on_signal the worker may stop in it
            losses[str(engine.global_step)] = mean.item()
            with open(path + ".tmp", "w") as f:
                json.dump(losses, f)
            os.replace(path + ".tmp", path)
            print(f"step {engine.global_step} loss {mean.item():.6f}", flush=True)
        engine.step()
        time.sleep(pause)
    if rank == 0:
        with open(os.path.join(out, "world.json"), "w") as f:
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            json.dump({"world_size": world, "nodes": nodes,
                       "params": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}, f)


if __name__ == "__main__":
    main()
