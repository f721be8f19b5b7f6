"""python scripts/bench_rendezvous.py [--runs 8] [--world 2] — what the signed rendezvous costs at start-up.

Forms a gloo group of ``--world`` local processes, ``--runs`` times each way: torch's env://
rendezvous, and zerorun's signed one (Note [authenticated rendezvous] in
zerorun/zero/comm/rendezvous.py: HMAC-signed store values, then a challenge and an answer between
every pair of ranks). Rank 0 starts first and listens; the others start once it does, and each
times ``init_process_group`` (plus the pair proofs) from its call to its return. Prints the median
over runs of the slowest rank's time, each way, and the difference.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

RANK = r'''
import os, sys, time
import torch.distributed as dist
from zerorun.zero.comm import rendezvous
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
started = time.perf_counter()
if os.environ.get("ZERORUN_RENDEZVOUS") == "signed":
    rendezvous.init_signed("gloo", rank, world, rendezvous.secret_for(os.environ))
else:
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
took = time.perf_counter() - started
dist.barrier()
print(f"{took:.6f}", flush=True)
dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _accepting(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def one_run(world: int, signed: bool) -> float:
    port = _free_port()
    root = str(Path(__file__).resolve().parents[1])
    base = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "ZERORUN_RUN_TOKEN": "bench-secret"}
    if signed:
        base["ZERORUN_RENDEZVOUS"] = "signed"
    procs = [subprocess.Popen([sys.executable, "-c", RANK], env={**base, "RANK": "0"}, stdout=subprocess.PIPE, text=True)]
    while not _accepting(port):
        time.sleep(0.01)
    procs += [subprocess.Popen([sys.executable, "-c", RANK], env={**base, "RANK": str(r)}, stdout=subprocess.PIPE, text=True)
              for r in range(1, world)]
    times = [float(proc.communicate(timeout=300)[0].strip().splitlines()[-1]) for proc in procs]
    # Rank 0 waits for the others to start (imports); the joining ranks time the rendezvous itself.
    return max(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    results = {False: [], True: []}
    for _ in range(args.runs):
        for signed in (False, True):  # interleaved, so load changes hit both alike
            results[signed].append(one_run(args.world, signed))
    plain, signed = statistics.median(results[False]), statistics.median(results[True])
    print(f"world {args.world}, {args.runs} runs each, median of the slowest joining rank's time:")
    print(f"  torch env://       {plain * 1000:8.1f} ms")
    print(f"  zerorun signed     {signed * 1000:8.1f} ms   ({(signed - plain) * 1000:+.1f} ms)")


if __name__ == "__main__":
    main()
