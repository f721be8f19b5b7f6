"""pytest tests/e2e/test_multinode.py — multi-node for real: OpenSSH on loopback, two "hosts".

A module fixture starts sshd on 127.0.0.1 and 127.0.0.2 (non-standard port, throwaway keys).
127.0.0.1 is this machine, so its ranks run in-process through the launcher's local agent;
127.0.0.2 is reached over ssh, where ``python -m zerorun.launch.agent`` runs its ranks. Both
paths are therefore exercised by one 4-rank job.
"""

from __future__ import annotations

import os
import shlex
import signal
import time

import pytest
import psutil
from launch_helpers import (
    FAILER,
    HANGER,
    assert_no_job_processes,
    kill_group,
    run_cli,
    start_cli,
    wait_for_files,
)
from sshd_server import LoopbackSshd, sshd_available

pytestmark = [pytest.mark.slow, pytest.mark.ssh, pytest.mark.long]  # a real sshd

ECHO_ARGS = r'''
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("RESULT " + repr((dist.get_rank(), os.environ["ZERORUN_HOST"], os.environ["LOCAL_RANK"], t.item(), sys.argv[1:])), flush=True)
import zerorun
zerorun.leave_together()  # barrier, then destroy without gloo's exit abort (Note [clean exit])
'''

NASTY_ARGS = ["two words", "it's \"quoted\"", "; touch PWNED_SEMI", "$(touch PWNED_SUBST)", "`touch PWNED_TICK`", "*"]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    reason = sshd_available()
    if reason:
        pytest.skip(reason)
    server = LoopbackSshd(tmp_path_factory.mktemp("sshd")).start()
    yield server
    server.stop()


def ssh_env(server: LoopbackSshd) -> dict:
    return {"ZERORUN_SSH_OPTS": " ".join(shlex.quote(o) for o in server.ssh_options)}


def test_four_ranks_on_two_loopback_hosts_run_to_completion(sshd, tmp_path):
    (tmp_path / "echo_args.py").write_text(ECHO_ARGS)
    (tmp_path / "hosts").write_text("# two loopback hosts\n127.0.0.1 slots=2\n127.0.0.2 slots=2\n")
    run_dir = tmp_path / "run"
    done = run_cli(
        ["--hostfile", "hosts", "--ssh-port", str(sshd.port), "--no-dashboard", "--run-dir", str(run_dir),
         "echo_args.py", *NASTY_ARGS],
        tmp_path,
        env=ssh_env(sshd),
    )
    assert done.returncode == 0, done.stderr
    expected_hosts = {0: "127.0.0.1", 1: "127.0.0.1", 2: "127.0.0.2", 3: "127.0.0.2"}
    for rank, host in expected_hosts.items():
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"RESULT {(rank, host, str(rank % 2), 10.0, NASTY_ARGS)!r}" in log
    assert not list(tmp_path.glob("PWNED*")) and not list(tmp_path.parent.glob("PWNED*"))


def test_killed_worker_on_second_host_ends_the_whole_job(sshd, tmp_path):
    (tmp_path / "failer.py").write_text(FAILER)
    (tmp_path / "hosts").write_text("127.0.0.1 slots=2\n127.0.0.2 slots=2\n")
    run_dir = tmp_path / "run"
    proc = start_cli(
        ["--hostfile", "hosts", "--ssh-port", str(sshd.port), "--no-dashboard", "--run-dir", str(run_dir),
         "failer.py", "sleep", "-1"],
        tmp_path,
        env=ssh_env(sshd),
    )
    try:
        wait_for_files([run_dir / f"pid{r}" for r in range(4)], proc=proc)
        pids = [int((run_dir / f"pid{r}").read_text()) for r in range(4)]
        killed = time.time()
        os.kill(pids[3], signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        assert time.time() - killed < 5.0
    finally:
        kill_group(proc)
    assert proc.returncode == 1
    assert "zerorun: error: rank 3 on host 127.0.0.2 failed: signal SIGKILL" in err
    assert_no_job_processes(run_dir, pids)


def test_preflight_reports_every_problem_at_once(sshd, tmp_path):
    (tmp_path / "job.py").write_text("print('x')\n")
    # 127.0.0.3 has no sshd; on 127.0.0.2 the working directory exists (same machine), so
    # the second problem is made by a script that exists here but is missing for -m lookup.
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.3 slots=1\n127.0.0.2 slots=1\n")
    done = run_cli(
        ["--hostfile", "hosts", "--ssh-port", str(sshd.port), "-m", "no_such_module_here"],
        tmp_path,
        env=ssh_env(sshd),
    )
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("zerorun: error: pre-flight found 3 problems:"), done.stderr
    assert "127.0.0.1: module no_such_module_here not found" in line
    assert "127.0.0.3: unreachable over ssh" in line
    assert "127.0.0.2: module no_such_module_here not found" in line
    assert not (tmp_path / "zerorun-runs").exists()


@pytest.mark.parametrize("workers", ["idle", "blocked"])
def test_sigkilled_remote_agent_leaves_no_worker_behind(sshd, tmp_path, workers):
    """The agent on 127.0.0.2 dies: its worker goes with it and the launcher says what happened."""
    (tmp_path / "job.py").write_text(FAILER if workers == "idle" else HANGER)
    args = ["job.py", "sleep", "-1"] if workers == "idle" else ["job.py", "script"]
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    run_dir = tmp_path / "run"
    proc = start_cli(
        ["--hostfile", "hosts", "--ssh-port", str(sshd.port), "--no-dashboard", "--hang-timeout", "0",
         "--run-dir", str(run_dir), *args],
        tmp_path,
        env=ssh_env(sshd),
    )
    try:
        wait_for_files([run_dir / "pid0", run_dir / "pid1"], proc=proc)
        pids = [int((run_dir / f"pid{r}").read_text()) for r in (0, 1)]
        remote_agent = psutil.Process(pids[1]).ppid()
        assert "zerorun.launch.agent" in " ".join(psutil.Process(remote_agent).cmdline())
        os.kill(remote_agent, signal.SIGKILL)
        killed = time.monotonic()
        out, err = proc.communicate(timeout=40)
        assert_no_job_processes(run_dir, pids, within_s=5.0 - (time.monotonic() - killed))
    finally:
        kill_group(proc)
    assert proc.returncode == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("zerorun: error: host 127.0.0.2 failed: lost the ssh session to its agent"), err
    assert last.endswith(f"every worker was stopped (logs in {run_dir}/logs)"), err


def test_hang_with_the_stuck_rank_on_the_remote_host_is_blamed_with_both_stacks(sshd, tmp_path):
    (tmp_path / "hanger.py").write_text(HANGER)
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    run_dir = tmp_path / "run"
    done = run_cli(
        ["--hostfile", "hosts", "--ssh-port", str(sshd.port), "--no-dashboard", "--hang-timeout", "6",
         "--run-dir", str(run_dir), "hanger.py", "script"],
        tmp_path,
        env=ssh_env(sshd),
        timeout=90,
    )
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("zerorun: error: rank 1 on host 127.0.0.2 failed: hung:"), done.stderr
    assert "rank 0: waiting in a collective; at " in done.stderr
    assert "rank 1: not in a collective; at " in done.stderr and "hanger.py" in done.stderr
    assert "in stuck_here" in done.stderr
