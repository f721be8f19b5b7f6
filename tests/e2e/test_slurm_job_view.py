"""pytest -m slurm tests/e2e/test_slurm_job_view.py (long: not in the default run) — node 0's job-wide view under a real srun.

Issue 38 (token holders, and the ports table of docs/launch.md). ``srun -N2 --ntasks-per-node=1
zerorun`` on the private cluster of slurm_cluster.py (nodes n1 and n2, both this host), the
tiny job of slurm_train.py slowed to a step every 2 s so the test can act while it trains:

- the launchers' listening sockets are what docs/launch.md's table says of them: node 0's
  launcher one port, on every interface, the one its job-view file names; node 1's none;
- a process that holds the token (it can read node 0's job-view file) and says hello as node 1
  once node 1 has joined is refused; the forged failed exit it would have sent never counts,
  the job succeeds, and node 0 names the refused connection in one line. Before, the hello was
  answered "ok" and the forged exit failed the finished job.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time

import psutil
import pytest
from launch_helpers import REPO, kill_group
from test_slurm_jobs import TRAIN, cluster, job_env, live_workers, wait_for, zerorun_cmd  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.long]  # a real Slurm

STEPS, PAUSE_S = 6, 2.0


def _listening(pid: int) -> list[tuple[str, int]]:
    return sorted((c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
                  if c.pid == pid and c.status == psutil.CONN_LISTEN)


def _documented_view_listener() -> str:
    table = (REPO / "docs" / "launch.md").read_text().split("<!-- ports table -->")[1]
    row = next(line for line in table.splitlines() if line.startswith("| node 0's launcher"))
    return [cell.strip() for cell in row.strip().strip("|").split("|")][1]


def _forge(port: int, token: str) -> bytes:
    """Hello as node 1 with the token; when answered "ok", rank 1's failed exit and "done"."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(json.dumps({"t": "hello", "token": token, "node": 1}).encode() + b"\n")
        answer = sock.makefile("rb").readline(16)
        if answer == b"ok\n":
            for event in ({"t": "exit", "rank": 1, "rc": 1, "at": time.time(), "tail": ["forged"]}, {"t": "done"}):
                sock.sendall(json.dumps(event).encode() + b"\n")
            time.sleep(0.5)
        return answer


def test_node_0s_view_listens_where_the_docs_say_and_a_node_joins_once(cluster, tmp_path):  # noqa: F811
    assert _documented_view_listener() == "one ephemeral port, every interface"
    job = subprocess.Popen(["srun", "-N2", "--ntasks-per-node=1",
                            *zerorun_cmd(str(TRAIN), str(STEPS), str(tmp_path), str(PAUSE_S)).split()],
                           cwd=tmp_path, env=job_env(cluster), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        view = wait_for(lambda: next(tmp_path.glob("zerorun-runs/slurm-*/node0/job-view.json"), None), 90,
                        "node 0's job-view file")
        wait_for(lambda: len(list(tmp_path.glob("pid.*"))) == 2, 90, "both ranks to start")
        data = json.loads(view.read_text())
        port, token = data["port"], data["token"]

        def node1_joined():
            return next((c for c in psutil.net_connections(kind="inet") if c.raddr and c.raddr.port == port
                         and c.status == psutil.CONN_ESTABLISHED and c.pid is not None), None)

        node1 = psutil.Process(wait_for(node1_joined, 60, "node 1's launcher to join node 0's view").pid)
        node0 = next(c.pid for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port)
        assert "zerorun" in " ".join(psutil.Process(node0).cmdline()) and "zerorun" in " ".join(node1.cmdline())
        assert _listening(node0) in ([("::", port)], [("0.0.0.0", port)]), _listening(node0)
        assert _listening(node1.pid) == [], _listening(node1.pid)
        assert _forge(port, token) == b"", "node 0 took a second hello for node 1"
        out, err = job.communicate(timeout=180)
    finally:
        kill_group(job)
    assert job.returncode == 0, out[-3000:] + err[-3000:]
    assert out.count("node 1 (n2): refused 1 more connection(s) claiming it after it had joined") == 1, out
    assert "zerorun summary (failed" not in out and out.count("zerorun summary") == 1, out
    assert len(json.loads((tmp_path / "losses.json").read_text())) == STEPS
    assert live_workers(tmp_path) == []
