"""python scripts/bench_telemetry.py [--blocks 60] [--steps 5] [--ranks 2] [--stage 2 | --plain]

Telemetry on against off, in the same run: step time of a small data-parallel training loop.

It launches itself through the real CLI (``zerorun --nproc 2 --no-dashboard``) so the whole
path is measured: worker recorder, pipe, node agent, launcher-side collector and metrics file.
Each worker trains a small MLP through ``zerorun.initialize`` (ZeRO stage 2 by default; the
engine calls record_step itself), or with ``--plain`` all-reduces every gradient separately
through zerorun.zero.comm.collectives (many small collectives per step: the worst case for
per-collective overhead). Blocks of steps alternate OFF / ON (ABAB..., so machine noise hits both alike); an
ON block routes collectives (observer) and steps (record_step) to a Recorder, an OFF block to a
NullRecorder with no observer; the recorder's 1 s sampling thread runs throughout and its cost
is measured apart. Rank 0 prints the median step time of each mode and the ratio,
plus the recorder's own cost per step measured directly (a steadier figure on a noisy machine).
Target: ON/OFF - 1 < 2%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def launch(args) -> int:
    """The outer process: start the workers through zerorun itself."""
    import tempfile

    run_dir = Path(tempfile.mkdtemp(prefix="zerorun-bench-telemetry-"))
    cmd = [sys.executable, "-m", "zerorun", "--nproc", str(args.ranks), "--no-dashboard", "--run-dir", str(run_dir),
           __file__, "--worker", "--blocks", str(args.blocks), "--steps", str(args.steps), "--stage", str(args.stage)]
    if args.plain:
        cmd.append("--plain")
    print("running:", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        print(f"metrics.jsonl: {sum(1 for _ in metrics.open())} records in {run_dir}")
    return rc


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from zerorun.telemetry import NullRecorder
    from zerorun.telemetry.recorder import recorder_from_env
    from zerorun.zero.comm import collectives

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    engine = None
    if not args.plain:
        import zerorun

        engine = zerorun.initialize(model, opt, {"zero": {"stage": args.stage}})
    step = 0

    def train_block(rec) -> list[float]:
        nonlocal step
        times = []
        if engine is not None:
            engine._recorder = rec  # the engine took get_recorder() once; swap it per block
        for _ in range(args.steps):
            start = time.perf_counter()
            if engine is not None:
                loss = torch.nn.functional.cross_entropy(engine(x), y)
                engine.backward(loss)
                engine.step()  # records the step itself
            else:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                for p in model.parameters():
                    collectives.all_reduce(p.grad, group=None)
                    p.grad.div_(world)
                opt.step()
                step += 1
                rec.record_step(step=step, loss=loss.detach(), lr=0.01, samples=64,
                                step_time_s=time.perf_counter() - start)
            times.append(time.perf_counter() - start)
        return times

    train_block(NullRecorder())  # warm-up: allocator, gloo buffers
    # One recorder for the whole run (its 1 s sampling thread runs throughout: measured apart
    # below); an ON block routes steps and collectives to it, an OFF block to nothing. Short
    # alternating blocks let a shared machine's drifts hit both modes alike.
    recorder = recorder_from_env()
    if recorder is None:
        raise SystemExit("ZERORUN_TELEMETRY_FD is not set: run this script without --worker")
    collectives.remove_observer(recorder)
    per_mode: dict[str, list[float]] = {"off": [], "on": []}
    for block in range(args.blocks):
        mode = "on" if block % 2 else "off"
        collectives.barrier(group=None)  # both ranks start the block together
        if mode == "on":
            collectives.add_observer(recorder)
        per_mode[mode].append(statistics.mean(train_block(recorder if mode == "on" else NullRecorder())))
        collectives.remove_observer(recorder)
    sample_cost = timed(recorder.send_sample, 50)
    recorder.close()
    direct = recorder_cost_per_step(len(list(model.parameters())))  # >= collectives per step either way
    if rank == 0:
        off, on = statistics.median(per_mode["off"]), statistics.median(per_mode["on"])
        # Each ON block against the OFF block just before it: slow drifts of a shared machine cancel.
        ratios = [b / a for a, b in zip(per_mode["off"], per_mode["on"], strict=True)]
        ratio = statistics.median(ratios)
        noise = 2 * statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
        what = "plain collectives" if engine is None else f"zerorun.initialize stage {args.stage}"
        print(f"step time  off {off * 1e3:.2f} ms  on {on * 1e3:.2f} ms  (medians of {args.blocks // 2} blocks "
              f"x {args.steps} steps, {world} ranks, {what})")
        print(f"telemetry on/off = {ratio:.4f} (median of paired blocks)  ->  {100 * (ratio - 1):+.2f}% step time "
              f"(target < 2%); mean {statistics.mean(ratios):.4f} +- {noise:.4f} (2 standard errors: the noise)")
        print(f"recorder cost measured directly: {direct * 1e6:.1f} us/step = {100 * direct / off:.3f}% of a step; "
              f"one sample {sample_cost * 1e6:.0f} us per {recorder.interval_s:g} s = "
              f"{100 * sample_cost / recorder.interval_s:.3f}% of a core")
    dist.barrier()
    dist.destroy_process_group()


def timed(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def recorder_cost_per_step(collectives_per_step: int, repeats: int = 2000) -> float:
    """Seconds per step spent in the recorder: in the training thread (observer calls and
    record_step) plus the sampling thread's writing of that step (it shares the GIL)."""
    from zerorun.telemetry.recorder import PipeWriter, Recorder

    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    rec = Recorder(PipeWriter(write_fd), token="bench", rank=0, host="bench", world_size=1, interval_s=3600)
    start = time.perf_counter()
    for i in range(repeats):
        for j in range(collectives_per_step):
            seq = i * collectives_per_step + j
            rec.collective_started(seq, "all_reduce", 4096)
            rec.collective_finished(seq, "all_reduce", 4096, 1e-4)
        rec.record_step(step=i, loss=1.0, lr=0.01, samples=64, step_time_s=0.01)
        if i % 100 == 99:
            rec.send_sample()  # writes the queued steps, as the sampling thread would
            try:
                while os.read(read_fd, 1 << 20):
                    pass
            except BlockingIOError:
                pass
    cost = (time.perf_counter() - start) / repeats
    os.close(read_fd)
    os.close(write_fd)
    return cost


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--blocks", type=int, default=60, help="alternating OFF/ON blocks (even)")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage of the engine")
    parser.add_argument("--plain", action="store_true", help="plain collectives instead of zerorun.initialize")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
