"""python scripts/bench_cpu.py [--preset bench] [--steps 8] [--warmup 2] [--repeats 1] [--json results.json]

The CPU benchmark of GUIDE §5: the 33.7M-parameter GPT of examples/gpt.py, fp32, AdamW,
micro-batch 4 x 128 tokens per rank, 2 gloo ranks, trained by torch DDP, FSDP2
(reshard_after_forward True and False) and zerorun stages 0-3, all in this one run so the
ratios compare like with like on whatever else the machine is doing.

Each system gets a fresh world of spawned processes (file:// rendezvous, no port), the same
initial weights, the same global batches, the same warmup and step count. Reported per system:
step time = median over the timed steps of the slowest rank's step (and the CPU seconds a rank
spends per step, less sensitive to other load on the machine); peak RSS = the largest
rank's high-water resident memory over its whole life (getrusage, fresh process, so no peak
leaks in from another system); model state = params + grads + optimizer state held per rank
after the last step (zerorun: engine.memory_breakdown(), which includes the gradient buffers
stages 0-2 keep; stage 3, DDP and FSDP2 have freed their gradients by then, and DDP's buckets
are not counted).

Targets (issue 20, tightening issue 2's): zerorun stages 1-3 <= 1.0x DDP step time, stage 3
peak RSS <= 0.75x DDP's. Wall time on a shared 2-core machine swings by tens of percent with other
load: use --repeats (interleaved rounds) and read the CPU-time column beside it, and the
per-round ratios printed under the table (each system against the DDP run of its own round).

On gloo, zerorun's reduce-scatters and all-gathers between ranks on one host go through shared
memory (zerorun/zero/comm/host_channel.py); DDP and FSDP2 use gloo's TCP collectives, as torch
offers them. ZERORUN_HOST_CHANNEL=0 runs zerorun on gloo's TCP too (its point-to-point ring).

    python scripts/bench_cpu.py --preset tiny --steps 3 --warmup 1      # a quick smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

from bench_systems import (  # noqa: E402
    SYSTEMS, RankResult, build_trainer, merge_repeats, parse_shared_options, render_table, run_world, time_steps,
)

TARGETS = {"zero1": {"step": 1.0}, "zero2": {"step": 1.0}, "zero3": {"step": 1.0, "memory": 0.75}}


def parse_args(argv=None) -> argparse.Namespace:
    from gpt import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=8, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over all systems, interleaved (median round per system): evens out load drift")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / nproc)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list from {','.join(SYSTEMS)}")
    parser.add_argument("--zerorun-config", default="{}", help="JSON merged into every zerorun config")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    parse_shared_options(parser, args)
    if min(args.steps, args.nproc, args.micro_batch, args.repeats) < 1 or args.warmup < 0:
        parser.error("--steps, --nproc, --micro-batch and --repeats must be >= 1, --warmup >= 0")
    return args


def rank_main(rank: int, world: int, system: str, options: dict, init_file: str) -> RankResult:
    """One rank of one system's world (runs in a spawned process)."""
    import torch
    import torch.distributed as dist
    from gpt import GPT, Block, preset, rank_slice, synthetic_batch

    torch.set_num_threads(options["threads"])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = preset(options["preset"])
    torch.manual_seed(0)
    model = GPT(cfg)
    trainer = build_trainer(system, model, lr=1e-4, block_class=Block, zerorun_config=options["zerorun_config"])

    def batches(step: int):
        tokens, targets = synthetic_batch(cfg, options["micro_batch"] * world, step=step)
        return rank_slice(tokens, rank, world), rank_slice(targets, rank, world)

    return time_steps(trainer, batches, options["warmup"], options["steps"], synchronize=lambda: None)


def main(argv=None) -> int:
    from rich.console import Console

    from gpt import GPT, count_parameters, preset

    args = parse_args(argv)
    console = Console(width=120) if not Console().is_terminal else Console()
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)
    options = {"preset": args.preset, "steps": args.steps, "warmup": args.warmup,
               "micro_batch": args.micro_batch, "threads": threads, "zerorun_config": args.zerorun_config}
    cfg = preset(args.preset)
    console.print(f"GPT {args.preset}: {count_parameters(GPT(cfg)):,} params, fp32, AdamW, "
                  f"{args.micro_batch} x {cfg.seq_len} tokens per rank, {args.nproc} gloo ranks x "
                  f"{threads} threads, {args.warmup} warmup + {args.steps} timed steps")
    rounds: dict[str, list] = {system: [] for system in args.systems}
    with tempfile.TemporaryDirectory(prefix="zerorun-bench-") as workdir:
        for round_index in range(args.repeats):
            for system in args.systems:
                console.print(f"  round {round_index + 1}/{args.repeats} {system} ...", end=" ")
                result = run_world(rank_main, args.nproc, system, options, Path(workdir) / str(round_index))
                rounds[system].append(result)
                console.print(f"failed: {result.error}" if result.error else
                              f"{result.step_s:.3f} s/step ({result.step_cpu_s:.3f} s CPU), "
                              f"peak RSS {result.peak_rss_mib:.0f} MiB")
    results = [merge_repeats(rounds[system]) for system in args.systems]
    console.print(render_table("CPU benchmark (ratios against DDP in this run)", results, "ddp", TARGETS))
    for line in round_ratios(rounds, "ddp"):
        console.print(line)
    for r in results:
        if r.error:
            console.print(f"[red]{r.system} failed:[/red] {r.error}")
    if args.json_path:
        payload = {"options": {**options, "nproc": args.nproc, "preset_config": dataclasses.asdict(cfg)},
                   "results": [dataclasses.asdict(r) for r in results]}
        Path(args.json_path).write_text(json.dumps(payload, indent=2))
    return 1 if any(r.error for r in results) else 0


def round_ratios(rounds: dict[str, list], baseline: str) -> list[str]:
    """Each system's step time over the baseline's in the same round, and their median. On a
    shared machine whose load drifts, the two runs of a round are a minute apart, while two
    systems' median rounds can be many minutes apart."""
    import statistics

    lines: list[str] = []
    if baseline not in rounds:
        return lines
    for system, results in rounds.items():
        pairs = [r.step_s / b.step_s for r, b in zip(results, rounds[baseline], strict=True)
                 if r.error is None and b.error is None and b.step_s > 0]
        if system != baseline and pairs:
            lines.append(f"  {system} step / {baseline} step by round: " + " ".join(f"{x:.2f}" for x in pairs)
                         + f" (median {statistics.median(pairs):.2f})")
    return lines


if __name__ == "__main__":
    sys.exit(main())
