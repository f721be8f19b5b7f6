"""zerorun --nproc 2 --config zerorun/templates/zero3.yaml examples/train_gpt.py --steps 30

The demo: trains the small GPT of examples/gpt.py on a synthetic, learnable token stream and
prints the loss of every step from rank 0. Also runs on its own as one process:

    python examples/train_gpt.py --steps 20

It resumes: ``--steps`` is the total, so after ``zerorun ... --resume examples/train_gpt.py
--steps 30`` (or ``checkpoint.resume: true``) it continues from the checkpoint's step to 30 on
the batches the uninterrupted run would have taken.

Everything distributed is in ``zerorun.initialize``: it joins the process group the launcher
describes (RANK, WORLD_SIZE, ...) and reads the launcher's config (ZERORUN_CONFIG), or runs as
world size 1 when started plainly. ``--config`` overrides the config for a plain run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zerorun
from zerorun.zero.activation_checkpointing import is_checkpointed
from gpt import GPT, count_parameters, preset, rank_slice, synthetic_batch


DEFAULT_LR = 3e-3


def configured_lr(config: str | None) -> float | None:
    """optimizer.params.lr of the config the engine will read (the launcher's, or --config), so the
    script's own AdamW steps with it and nothing in the config is silently overridden."""
    from zerorun.config import load_config

    launched = os.environ.get("ZERORUN_CONFIG")
    source = config or launched
    if not source:
        return None
    # The launcher's file is resolved already (environment included): environ={} reads it as it is.
    resolved = load_config(source, environ={} if source == launched else None)
    return resolved.optimizer.params.get("lr") if resolved.optimizer is not None else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    parser.add_argument("--preset", default="tiny", help="model size: nano, tiny, bench")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences per rank per step (default: the config's batch.micro_batch_size, else 8)")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"learning rate (default: the config's optimizer.params.lr, else {DEFAULT_LR})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default=None, help="zerorun YAML / DeepSpeed JSON (plain runs)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = preset(args.preset)
    # Every rank builds the same initial weights; the engine shards them from there.
    torch.manual_seed(args.seed)
    device = _device()
    model = GPT(cfg).to(device)
    lr = args.lr if args.lr is not None else configured_lr(args.config) or DEFAULT_LR
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    engine = zerorun.initialize(model, optimizer, args.config)
    if args.steps and hasattr(engine, "set_total_steps"):
        engine.set_total_steps(args.steps)  # the dashboard's progress bar and ETA

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    configured = getattr(getattr(engine, "config", None), "batch", None)
    args.micro_batch = args.micro_batch or getattr(configured, "micro_batch_size", None) or 8
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"GPT {args.preset}: {count_parameters(model):,} parameters, world size {world}, "
        f"{args.micro_batch} x {cfg.seq_len} tokens per rank per step", flush=True)
    checkpointed = [name for name, module in model.named_modules() if is_checkpointed(module)]
    if checkpointed:
        say(f"activation checkpointing: {len(checkpointed)} modules ({', '.join(checkpointed)})", flush=True)

    # Resumable (docs/checkpoints.md, "Resuming a script"): the loop runs from the engine's step
    # (0, or the step a --resume / checkpoint.resume load restored) to --steps IN TOTAL, and the
    # data of step N is a function of N, so a resumed run trains on exactly the batches the
    # uninterrupted run would have taken from there.
    resumed_at = engine.global_step
    if resumed_at:
        say(f"resuming at step {resumed_at} of {args.steps}", flush=True)
    accumulation = engine.gradient_accumulation_steps()
    first_loss = last_loss = None
    started = time.perf_counter()
    while engine.global_step < args.steps:
        step = engine.global_step
        for micro in range(accumulation):
            # The global batch is the same for every world size; each rank takes its rows.
            index = step * accumulation + micro
            tokens, targets = synthetic_batch(cfg, args.micro_batch * world, step=index, seed=args.seed)
            tokens, targets = rank_slice(tokens, rank, world).to(device), rank_slice(targets, rank, world).to(device)
            loss = engine(tokens, targets)
            engine.backward(loss)
            if micro == accumulation - 1:
                # Reported before the step() that ends the window: with checkpoint.on_signal the
                # worker saves and stops inside it.
                mean_loss = _mean_over_ranks(loss.detach(), world)
                first_loss = mean_loss if first_loss is None else first_loss
                last_loss = mean_loss
                say(f"step {step + 1:>4}/{args.steps}  loss {mean_loss:.4f}", flush=True)
            engine.step()
    elapsed = time.perf_counter() - started
    ran = engine.global_step - resumed_at
    if ran:
        say(f"done: loss {first_loss:.4f} -> {last_loss:.4f} in {elapsed:.1f}s "
            f"({elapsed / ran * 1000:.0f} ms/step)", flush=True)
    return 0


def _device() -> torch.device:
    """This worker's device by the engine's own rule (docs/runtime.md, "The device contract"):
    the CPU under --nproc even on a GPU node, its GPU under --gpus, torchrun or srun."""
    from zerorun.worker.device import this_worker

    return this_worker().torch_device()


def _mean_over_ranks(loss: torch.Tensor, world: int) -> float:
    """The loss of the whole global batch, for display (each rank's loss is over its rows only)."""
    if world > 1:
        loss = loss.clone()
        dist.all_reduce(loss)
        loss /= world
    return loss.item()


if __name__ == "__main__":
    sys.exit(main())
