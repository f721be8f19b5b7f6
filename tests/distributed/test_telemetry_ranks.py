"""pytest tests/distributed/test_telemetry_ranks.py — two gloo ranks stream telemetry into a JobView.

The launcher's part is played by the test: it creates one pipe per rank, passes the write end
as ZERORUN_TELEMETRY_FD, and feeds every line it reads to ``JobView.on_telemetry``. Rank 1 is
held back before the last collective, so the view must name it in a hang line. Run directly
(``python tests/distributed/test_telemetry_ranks.py RANK WORLD RDZV_FILE``) it is one worker.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from gloo_world import run_ranks

STEPS = 5
HOLD_S = 4.0  # how long rank 1 stays out of the final barrier
HANG_AFTER_S = 1.0


def worker(rank: int, world_size: int, rdzv_file: str) -> None:
    import torch
    import torch.distributed as dist

    from zerorun.telemetry import get_recorder
    from zerorun.zero.comm import collectives
    from zerorun.zero.comm.process_group import leave_together

    dist.init_process_group("gloo", init_method=f"file://{rdzv_file}", rank=rank, world_size=world_size)
    rec = get_recorder()
    grads = torch.ones(4096)
    weights = torch.zeros(128)
    for step in range(1, STEPS + 1):
        start = time.perf_counter()
        collectives.all_reduce(grads, group=None)
        collectives.broadcast(weights, src=0, group=None)
        rec.record_step(step=step, loss=1.0 / step, lr=0.1, samples=4, step_time_s=time.perf_counter() - start)
    if rank == 1:
        time.sleep(HOLD_S)  # the straggler: everyone else waits for it in the barrier
    collectives.barrier(group=None)
    leave_together()  # Note [clean exit] in zerorun/zero/comm/process_group.py


@pytest.mark.slow
def test_two_ranks_stream_memory_comm_steps_and_a_hang(tmp_path):
    from zerorun.ui.live import JobView

    world_size = 2
    out = io.StringIO()
    view = JobView(run_dir=tmp_path, token="tok", world_size=world_size, dashboard=False, stream=out,
                   hang_after_s=HANG_AFTER_S, status_interval_s=1.0)
    view.start()
    procs, readers = [], []
    try:
        for rank in range(world_size):
            read_fd, write_fd = os.pipe()
            env = {**os.environ, "ZERORUN_TELEMETRY_FD": str(write_fd), "ZERORUN_RUN_TOKEN": "tok",
                   "RANK": str(rank), "WORLD_SIZE": str(world_size), "ZERORUN_HOST": f"host{rank}",
                   "ZERORUN_TELEMETRY_INTERVAL": "0.2", "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, __file__, str(rank), str(world_size), str(tmp_path / "rdzv")],
                                          env=env, pass_fds=(write_fd,)))
            os.close(write_fd)
            reader = threading.Thread(target=_pump, args=(view, f"host{rank}", read_fd), daemon=True)
            reader.start()
            readers.append(reader)
        for rank, proc in enumerate(procs):
            view.on_worker_exit(f"host{rank}", rank, proc.wait(timeout=300))
        for reader in readers:
            reader.join(timeout=10)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        view.stop(failed=False)

    text = out.getvalue()
    assert [p.returncode for p in procs] == [0, 0], text
    # Each rank issued 2 collectives per step, so the barrier is collective #10 on both.
    assert f"HANG: rank 1 has not entered collective #{2 * STEPS} (barrier); rank 0 waiting" in text

    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for rank in range(world_size):
        mine = [r for r in records if r["rank"] == rank]
        assert {r["host"] for r in mine} == {f"host{rank}"}
        samples = [r for r in mine if r["kind"] == "sample"]
        assert samples and all(s["mem"]["rss"] > 10 << 20 for s in samples)
        counts = {}
        for s in samples:
            for op, (count, _nbytes, _seconds) in s["comm"].items():
                counts[op] = counts.get(op, 0) + count
        assert counts == {"all_reduce": STEPS, "broadcast": STEPS, "barrier": 1}, counts
        assert [r["step"] for r in mine if r["kind"] == "step"] == list(range(1, STEPS + 1))
        assert mine[0]["kind"] == "hello" and mine[-1]["kind"] == "bye"
    # While rank 1 slept, rank 0 reported itself blocked in the barrier.
    assert any(r["rank"] == 0 and (r.get("blocked") or {}).get("op") == "barrier" for r in records)

    summary = text[text.index("zerorun summary"):]
    assert "broadcast s" in summary and "all_reduce s" in summary and "barrier s" in summary
    assert "(5×)" in summary and "samples/s" in summary


def engine_ops(rank: int) -> dict:
    """A recorder started before zerorun's collectives were imported (worker/boot does that),
    not yet subscribed to them: building an engine must subscribe it before its first one."""
    import torch

    import zerorun
    import zerorun.telemetry as telemetry

    class Boot(telemetry.NullRecorder):
        def __init__(self):
            self.ops: list[str] = []

        def observe_collectives(self):  # as Recorder.observe_collectives, the observer part
            from zerorun.zero.comm import collectives

            if self not in collectives._observers:
                collectives.add_observer(self)

        def collective_started(self, seq, op, nbytes):
            pass

        def collective_finished(self, seq, op, nbytes, seconds, waited):
            self.ops.append(op)

    boot = Boot()
    telemetry._recorder, telemetry._created = boot, True
    torch.manual_seed(rank)  # different weights: rank 0's are broadcast
    zerorun.initialize(torch.nn.Linear(4, 3), None, {"zero": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    return {"ops": boot.ops}


@pytest.mark.slow
def test_every_rank_counts_the_engines_first_broadcast(tmp_path):
    """Note [every collective counted] in zerorun/zero/engine.py: under srun on two nodes, node
    1's rank showed "-" for broadcast in the summary (its recorder subscribed after it)."""
    results = run_ranks(engine_ops, 2, tmp_path, leave_together=False)
    for rank in (0, 1):
        assert "broadcast" in results[rank]["ops"], (rank, results[rank])


def _pump(view, host: str, read_fd: int) -> None:
    with os.fdopen(read_fd, "rb") as stream:
        for line in stream:
            view.on_telemetry(host, line.rstrip(b"\n"))


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
