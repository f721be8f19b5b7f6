"""Helpers shared by tests/e2e/test_launch*.py and test_multinode*.py: run the real CLI, watch its processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]

# Workers of the failure tests: no torch import (fast), each writes its pid so the test can
# kill it and later prove it is gone; rank FAIL_RANK misbehaves as argv[1] says.
FAILER = r'''
import os, sys, time, signal
rank = int(os.environ["RANK"])
run_dir = os.environ["ZERORUN_RUN_DIR"]
with open(os.path.join(run_dir, f"pid{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(run_dir, f"pid{rank}.tmp"), os.path.join(run_dir, f"pid{rank}"))
print(f"rank {rank} on {os.environ['ZERORUN_HOST']} up", flush=True)
mode, fail_rank = sys.argv[1], int(sys.argv[2])
if rank == fail_rank and mode == "exit3":
    print("giving up now", flush=True)
    with open(os.path.join(run_dir, "failed_at"), "w") as f:
        f.write(repr(time.time()))
    raise SystemExit(3)
if rank == fail_rank and mode == "raise":
    with open(os.path.join(run_dir, "failed_at"), "w") as f:
        f.write(repr(time.time()))
    raise ValueError("bad batch in rank " + str(rank))
time.sleep(120)
'''

# Ranks write their pid, then rank 1 waits forever at stuck_here() while rank 0 goes on into
# a collective (argv[1]: "script" = the script's own dist.all_reduce, "engine" = zerorun's
# collectives, "none" = rank 0 sleeps too). Lines are printed along the way so that a slow
# start on a loaded machine is progress, not a hang.
HANGER = r'''
print("starting", flush=True)
import os, sys, time
import torch, torch.distributed as dist
print("imported torch", flush=True)
dist.init_process_group("gloo")
rank, mode = dist.get_rank(), sys.argv[1]
t = torch.ones(3)
if mode == "engine":
    from zerorun.telemetry import get_recorder
    from zerorun.zero.comm import collectives
    get_recorder()
    collectives.all_reduce(t, group=None)
print("ready", flush=True)
run_dir = os.environ["ZERORUN_RUN_DIR"]
with open(os.path.join(run_dir, f"pid{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(run_dir, f"pid{rank}.tmp"), os.path.join(run_dir, f"pid{rank}"))

def stuck_here():
    time.sleep(300)

if rank == 1 or mode == "none":
    stuck_here()
if mode == "engine":
    collectives.all_reduce(t, group=None)
else:
    dist.all_reduce(t)
'''


def cli_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ZERORUN_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def zerorun_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "zerorun", *args]


def run_cli(args: list[str], cwd: Path, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(zerorun_argv(*args), cwd=cwd, env=cli_env(env), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def start_cli(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(zerorun_argv(*args), cwd=cwd, env=cli_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, start_new_session=True)


def wait_for_files(paths: list[Path], timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"launcher exited early: {proc.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {paths}")
        time.sleep(0.05)


def job_processes(run_dir: Path) -> list[psutil.Process]:
    """Every live process started for this job (found by its run dir in env or argv)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if proc.pid == os.getpid():
                continue
            env = proc.environ()
            if env.get("ZERORUN_RUN_DIR") == str(run_dir):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _still_running(pids: list[int]) -> list[int]:
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            continue
    return running


def assert_no_job_processes(run_dir: Path, pids: list[int], within_s: float = 0.0) -> None:
    """No worker in ``pids`` and no process of the job is left, waiting up to ``within_s`` for them to go.

    Waits on the very condition it asserts: a process in the middle of exiting has already lost
    its environment (so ``job_processes`` no longer sees it) but is not yet a zombie."""
    deadline = time.monotonic() + within_s
    while (_still_running(pids) or job_processes(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftover = _still_running(pids)
    assert not leftover, f"workers still alive: {leftover}"
    assert not job_processes(run_dir), "processes of the job are still running"


def kill_group(proc: subprocess.Popen) -> None:
    """Test cleanup: end the launcher we started (its own session), if a test failed midway."""
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
        proc.wait()


def channel_files() -> set[str]:
    """The host channel's names in /dev/shm now (comm/shm_names.py), of any job."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(("zerorun-outbox-", "zerorun-inbox-"))}


def channel_files_of(names: set[str], pids: list[int]) -> list[str]:
    """Names that belong to ``pids`` (or carry no pid at all: the older naming). Other jobs may
    run beside a test, so a test counts only its own workers' names."""
    theirs = re.compile(r"zerorun-(?:outbox|inbox)-(?:p(?:{})-.*|(?!p[0-9]+-).*)".format("|".join(map(str, pids))))
    return sorted(name for name in names if theirs.fullmatch(name))
