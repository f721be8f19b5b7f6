"""pytest tests/distributed/test_slurm_world.py — ``srun python train.py`` without srun: the world from faked Slurm variables.

Two processes get what srun gives two tasks of one step (SLURM_PROCID, SLURM_STEP_NUM_TASKS,
SLURM_LOCALID, SLURM_STEP_NODELIST; no RANK/WORLD_SIZE/MASTER_*); ``zerorun.initialize`` must
form one world of 2 over gloo. The real srun is exercised by tests/e2e/test_slurm_jobs.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = r'''
import json, os, sys, torch, zerorun
try:
    model = torch.nn.Linear(3, 2)
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero": {"stage": 1}})
except zerorun.errors.ZerorunError as err:
    print("ERROR " + str(err), flush=True)
    sys.exit(2)
t = torch.tensor([float(engine.rank + 1)])
torch.distributed.all_reduce(t)
print("WORLD " + json.dumps([engine.rank, engine.world_size, os.environ["RANK"], os.environ["MASTER_ADDR"], t.item()]), flush=True)
'''


def step_env(proc_id: int, port: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({
        "PYTHONPATH": str(REPO), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost",
        "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_PROCID": str(proc_id),
        "SLURM_LOCALID": str(proc_id), "MASTER_PORT": str(port), "ZERORUN_DEVICE": "cpu",
    })
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_tasks(tmp_path, envs) -> list[subprocess.CompletedProcess]:
    script = tmp_path / "world.py"
    script.write_text(SCRIPT)
    procs = [subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for env in envs]
    return [(proc, *proc.communicate(timeout=120)) for proc in procs]


@pytest.mark.slow
def test_two_slurm_tasks_form_one_world_of_two(tmp_path):
    port = free_port()
    results = run_tasks(tmp_path, [step_env(0, port), step_env(1, port)])
    worlds = []
    for proc, out, err in results:
        assert proc.returncode == 0, err[-2000:]
        worlds.append(json.loads(out.split("WORLD ", 1)[1]))
    assert sorted(worlds) == [[0, 2, "0", "localhost", 3.0], [1, 2, "1", "localhost", 3.0]]


def test_several_tasks_without_a_rank_is_an_error_not_a_world_of_one(tmp_path):
    (proc, out, err), = run_tasks(tmp_path, [step_env(0, free_port(), SLURM_PROCID=None)])
    assert proc.returncode == 2, err[-2000:]
    assert "SLURM_STEP_NUM_TASKS=2 but SLURM_PROCID not set" in out
