"""pytest tests/e2e/test_telemetry_cli.py — telemetry through the real ``zerorun`` CLI, as a subprocess.

One 2-rank job (shared by the tests below to pay for the worker start-up once): each rank does
a few steps of collectives and reports them; rank 1 then sleeps before a final barrier, so the
launcher must name it as not having entered that collective. ``zerorun report`` then reads the
run directory back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

STEPS = 4
HOLD_S = 5

TRAIN = textwrap.dedent(f"""
    import time
    import torch
    import torch.distributed as dist
    from zerorun.telemetry import get_recorder
    from zerorun.zero.comm import collectives
    from zerorun.zero.comm.process_group import leave_together

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rec = get_recorder()
    print("recorder", type(rec).__name__, flush=True)
    grads = torch.ones(10_000)
    for step in range(1, {STEPS} + 1):
        start = time.perf_counter()
        collectives.all_reduce(grads, group=None)
        collectives.broadcast(grads, src=0, group=None)
        rec.record_step(step=step, loss=1.0 / step, samples=4, step_time_s=time.perf_counter() - start)
    if rank == 1:
        time.sleep({HOLD_S})
    collectives.barrier(group=None)
    leave_together()  # Note [clean exit] in zerorun/zero/comm/process_group.py
""")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    work = tmp_path_factory.mktemp("telemetry_e2e")
    (work / "train.py").write_text(TRAIN)
    run_dir = work / "run"
    env = {**os.environ, "ZERORUN_HANG_AFTER_S": "1.5", "ZERORUN_TELEMETRY_INTERVAL": "0.25",
           "ZERORUN_TOTAL_STEPS": str(STEPS)}
    env.pop("ZERORUN_TELEMETRY_FD", None)
    proc = subprocess.run([sys.executable, "-m", "zerorun", "--nproc", "2", "--run-dir", str(run_dir), "train.py"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=90)
    return proc, run_dir


@pytest.mark.slow
def test_metrics_file_holds_memory_and_comm_from_every_rank(job):
    proc, run_dir = job
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("recorder Recorder") == 2
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("token" not in r for r in records)
    for rank in (0, 1):
        mine = [r for r in records if r["rank"] == rank]
        samples = [r for r in mine if r["kind"] == "sample"]
        assert samples and all(s["mem"]["rss"] > 0 for s in samples)
        ops: dict[str, list] = {}
        for s in samples:
            for op, (count, nbytes, _seconds) in s["comm"].items():
                ops.setdefault(op, [0, 0])
                ops[op][0] += count
                ops[op][1] += nbytes
        assert ops == {"all_reduce": [STEPS, STEPS * 40_000], "broadcast": [STEPS, STEPS * 40_000],
                       "barrier": [1, 0]}, ops
        assert [r["step"] for r in mine if r["kind"] == "step"] == list(range(1, STEPS + 1))
    summary = proc.stdout[proc.stdout.index("zerorun summary"):]
    assert "all_reduce s" in summary and "broadcast s" in summary and "job throughput" in summary


@pytest.mark.slow
def test_launcher_names_the_rank_held_back_before_a_collective(job):
    proc, _ = job
    # Each rank issued 2 collectives per step before the barrier.
    expected = f"HANG: rank 1 has not entered collective #{2 * STEPS} (barrier); rank 0 waiting"
    assert expected in proc.stdout, proc.stdout


@pytest.mark.slow
def test_report_reads_the_run_back(job):
    _, run_dir = job
    proc = subprocess.run([sys.executable, "-m", "zerorun", "report", str(run_dir), "--format", "html"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    page = (run_dir / "report.html").read_text()
    # memory, communication, bytes per link class (its steps record what they sent), steps
    assert page.count("data:image/png;base64,") == 4 and "<th>barrier (s)</th>" in page
