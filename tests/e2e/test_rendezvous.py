"""pytest tests/e2e/test_rendezvous.py — the job's rendezvous admits only its own ranks; its ports are the documented ones.

Issue 38 item 2 (Note [authenticated rendezvous] in zerorun/zero/comm/rendezvous.py). Two CPU
ranks; rank 1 waits for a "go" file before it joins, so another process can connect first:

- an impostor that joins the rendezvous the way torch lets anyone (``init_process_group`` as
  rank 1 over ``tcp://MASTER_ADDR:MASTER_PORT``) used to become rank 1 and receive rank 0's
  parameters from the initial broadcast. Now it never receives a tensor, the job trains on with
  its own rank 1, and rank 0 names what happened in one warning line.
- the listening sockets of the launcher and the ranks, taken while the job runs, are those the
  table in docs/launch.md lists (and on loopback: a single-host job).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from launch_helpers import REPO, cli_env, job_processes, kill_group, start_cli, wait_for_files

pytestmark = pytest.mark.slow

SCRIPT = r'''
import os, sys, time, torch, zerorun
here = sys.argv[1]
if os.environ["RANK"] == "1":
    while not os.path.exists(os.path.join(here, "go")):
        time.sleep(0.05)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"zero": {"stage": 3}})
for step in range(3):
    loss = engine(torch.randn(4, 16, generator=torch.Generator().manual_seed(step))).pow(2).mean()
    engine.backward(loss)
    engine.step()
open(os.path.join(here, f"trained{engine.rank}"), "w").close()
while not os.path.exists(os.path.join(here, "end")):
    time.sleep(0.05)
'''

IMPOSTOR = r'''
import datetime, sys, torch, torch.distributed as dist
try:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=1, world_size=2,
                            timeout=datetime.timedelta(seconds=float(sys.argv[2])))
    print("JOINED", flush=True)
    received = torch.zeros(16 * 16 + 16)
    dist.broadcast(received, 0)
    print("GOT TENSOR", received.abs().sum().item(), flush=True)
except Exception as exc:
    print("REFUSED", type(exc).__name__, flush=True)
'''


def _master_port(run_dir: Path) -> int:
    plan = json.loads((run_dir / "plan.json").read_text())
    return int(re.search(r'"MASTER_PORT": "(\d+)"', json.dumps(plan)).group(1))


def _accepting(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _keys(port: int) -> list[str]:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    return store.list_keys()


def _start(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    run_dir = tmp_path / "run"
    job = start_cli(["--nproc", "2", "--no-dashboard", "--hang-timeout", "300", "--run-dir", str(run_dir),
                     "job.py", str(tmp_path)], tmp_path)
    wait_for_files([run_dir / "plan.json"], timeout=120, proc=job)
    port = _master_port(run_dir)
    deadline = time.monotonic() + 240
    while not _accepting(port):  # rank 0 listens: rank 1 is held back
        assert job.poll() is None and time.monotonic() < deadline, "rank 0 never opened the rendezvous"
        time.sleep(0.2)
    return job, run_dir, port


def test_an_impostor_at_the_rendezvous_never_receives_a_tensor_and_the_job_names_it(tmp_path):
    job, run_dir, port = _start(tmp_path)
    impostor = None
    try:
        before = len(_keys(port))
        impostor = subprocess.Popen([sys.executable, "-c", IMPOSTOR, str(port), "60"], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env=cli_env())
        deadline = time.monotonic() + 120
        while len(_keys(port)) <= before:  # the impostor has written its address as "rank 1"
            assert impostor.poll() is None and time.monotonic() < deadline, impostor.communicate()[0]
            time.sleep(0.2)
        (tmp_path / "go").touch()  # now the real rank 1 joins
        wait_for_files([tmp_path / "trained0", tmp_path / "trained1"], timeout=240, proc=job)
        (tmp_path / "end").touch()
        out, err = job.communicate(timeout=120)
        said = impostor.communicate(timeout=120)[0]
    finally:
        kill_group(job)
        if impostor is not None and impostor.poll() is None:
            impostor.kill()
            impostor.wait()
    assert "GOT TENSOR" not in said and "JOINED" not in said, said
    assert "REFUSED" in said, said
    assert job.returncode == 0, out[-2000:] + err[-2000:]
    log = (run_dir / "logs" / "rank0.log").read_text()
    warning = [line for line in log.splitlines() if "of this job's rendezvous at 127.0.0.1:" in line]
    assert warning and "written by something that does not know the launch's secret" in warning[0], log[-2000:]


def _documented_listeners() -> dict[str, str]:
    """process -> what docs/launch.md says it listens on (the ports table)."""
    text = (REPO / "docs" / "launch.md").read_text()
    table = text.split("<!-- ports table -->")[1]
    rows = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0] in ("launcher", "rank 0", "every rank"):
            rows[cells[0]] = cells[1]
    return rows


def test_the_ports_a_job_opens_are_those_docs_launch_md_lists(tmp_path):
    documented = _documented_listeners()
    assert documented["launcher"] == "none"
    assert "MASTER_PORT" in documented["rank 0"] and "127.0.0.1" in documented["rank 0"]
    assert "127.0.0.1" in documented["every rank"]
    (tmp_path / "go").touch()
    job, run_dir, port = _start(tmp_path)
    try:
        wait_for_files([tmp_path / "trained0", tmp_path / "trained1"], timeout=240, proc=job)
        listening: dict[str, list] = {"launcher": [], "rank 0": [], "rank 1": []}
        for proc in [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True), *job_processes(run_dir)]:
            rank = proc.environ().get("RANK")
            who = "launcher" if rank is None else f"rank {rank}"
            sockets = {(c.laddr.ip, c.laddr.port) for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN}
            listening[who] = sorted(set(listening[who]) | sockets)
        (tmp_path / "end").touch()
        job.communicate(timeout=120)
    finally:
        kill_group(job)
    assert listening["launcher"] == [], listening
    assert ("127.0.0.1", port) in listening["rank 0"], listening
    groups = [sock for sock in listening["rank 0"] if sock[1] != port]
    assert groups and len(listening["rank 1"]) == len(groups), listening  # one gloo listener per group, per rank
    assert all(ip == "127.0.0.1" for who in listening for ip, _ in listening[who]), listening
