"""python scripts/bench_launch.py [--runs 5] [--script {trivial,allreduce}]

Wall time of ``zerorun --nproc 2`` against ``torchrun --nproc-per-node 2`` on the same
trivial script, runs interleaved so both see the same machine load; prints each median and
the ratio zerorun / torchrun (target <= 1.2).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPTS = {
    # Start-up and teardown only: what the launcher itself costs.
    "trivial": "import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n",
    # One gloo rendezvous and collective: what a real job's first seconds cost.
    "allreduce": (
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(1); dist.all_reduce(t)\n"
        "print('rank', dist.get_rank(), 'sum', t.item())\n"
        "dist.barrier()\n"
        "dist.destroy_process_group()\n"
    ),
}


def timed(argv: list[str], cwd: Path, env: dict) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{argv[:4]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--script", choices=sorted(SCRIPTS), default="trivial")
    args = parser.parse_args()
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "job.py").write_text(SCRIPTS[args.script])
        commands = {
            "zerorun": [sys.executable, "-m", "zerorun", "--nproc", "2", "--no-dashboard",
                        "--run-dir", str(work / "run"), "job.py"],
            "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "job.py"],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for argv in commands.values():  # warm the page cache for both before timing
            timed(argv, work, env)
        for _ in range(args.runs):
            for name, argv in commands.items():
                times[name].append(timed(argv, work, env))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(f"{name:9s} median {medians[name]:.3f} s  runs {' '.join(f'{v:.2f}' for v in values)}")
    ratio = medians["zerorun"] / medians["torchrun"]
    print(f"ratio zerorun/torchrun = {ratio:.2f}x  (target <= 1.2x; script: {args.script}, {args.runs} runs)")


if __name__ == "__main__":
    main()
