"""python scripts/bench_offload.py [--preset bench] [--steps 6] [--warmup 2] [--repeats 1] [--json results.json]

Offload on CPU: the 33.7M-parameter GPT of examples/gpt.py (fp32, AdamW, micro-batch 4 x 128
tokens per rank, 2 gloo ranks) trained by zerorun stage 2 and stage 3 without offload, with the
optimizer offloaded to the host (``+cpu``), with it in files (``+nvme``, through one host buffer
sized for the largest unit) and, at stage 3, with the
parameters on the host as well (``+cpu+params``). Every offload mode is reported as a ratio to
the same stage without offload, measured in this run. Units are capped at the size of the
largest parameter for every system (so that one nvme buffer holds any unit).

On a machine without a GPU the device and the host are the same memory: what this measures is
the price of the offload machinery itself (a separate fp32 master, staging, the worker thread,
file I/O), not the PCIe traffic that offload costs on a GPU. Step time should stay near 1.0x;
the nvme rows' resident memory should drop by the optimizer state less the buffer.

    python scripts/bench_offload.py --preset tiny --steps 2 --warmup 1     # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

from bench_cpu import rank_main  # noqa: E402
from bench_systems import merge_repeats, ratio, run_world  # noqa: E402

SYSTEMS = ["zero2", "zero2+cpu", "zero2+nvme", "zero3", "zero3+cpu", "zero3+cpu+params", "zero3+nvme"]


def shared_settings(preset_name: str, nproc: int, workdir: str) -> dict:
    """For every system alike: units no larger than the largest parameter (the tied embedding),
    and, for nvme, one buffer big enough for the master and two Adam moments of a unit of
    twice that size (stage 3 may coalesce small modules up to it)."""
    from gpt import GPT, preset

    model = GPT(preset(preset_name))
    largest = max(p.numel() for p in model.parameters())
    # Stage 3 coalesces small modules into units of up to about twice the size asked for.
    chunk = -(-2 * largest // (nproc * 8)) * 8
    return {"zero": {"reduce_bucket_size": largest, "allgather_bucket_size": largest,
                     "offload_optimizer": {"nvme_path": workdir, "buffer_count": 1, "buffer_size": 3 * chunk}}}


def main(argv=None) -> int:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    console = Console(width=120) if not Console().is_terminal else Console()
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    rounds: dict[str, list] = {s: [] for s in SYSTEMS}
    with tempfile.TemporaryDirectory(prefix="zerorun-bench-offload-") as workdir:
        options = {"preset": args.preset, "steps": args.steps, "warmup": args.warmup, "micro_batch": args.micro_batch,
                   "threads": threads, "zerorun_config": shared_settings(args.preset, args.nproc, workdir)}
        for round_index in range(args.repeats):
            for system in SYSTEMS:
                console.print(f"  round {round_index + 1}/{args.repeats} {system} ...", end=" ")
                result = run_world(rank_main, args.nproc, system, options, Path(workdir) / str(round_index))
                rounds[system].append(result)
                console.print(f"failed: {result.error}" if result.error else
                              f"{result.step_s:.3f} s/step, peak RSS {result.peak_rss_mib:.0f} MiB, "
                              f"loss {result.last_loss:.4f}")
    results = {s: merge_repeats(r) for s, r in rounds.items()}
    table = Table(title=f"Offload on CPU, GPT {args.preset}, {args.nproc} ranks (ratios to the same stage without offload)")
    for column in ("system", "s/step", "x step", "CPU s", "x CPU", "peak RSS MiB", "x RSS", "last loss"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for system, r in results.items():
        base = results[system.split("+")[0]]
        if r.error:
            table.add_row(system, "failed", "", "", "", "", "", r.error[:40])
            continue
        fmt = lambda v: "" if v is None else f"{v:.2f}"
        table.add_row(system, f"{r.step_s:.3f}", fmt(ratio(r.step_s, base.step_s)), f"{r.step_cpu_s:.3f}",
                      fmt(ratio(r.step_cpu_s, base.step_cpu_s)), f"{r.peak_rss_mib:.0f}",
                      fmt(ratio(r.peak_rss_mib, base.peak_rss_mib)), f"{r.last_loss:.5f}")
    console.print(table)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({s: r.__dict__ for s, r in results.items()}, indent=2))
    return 1 if any(r.error for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
