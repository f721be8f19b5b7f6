"""pytest -m cuda tests/cuda/test_cuda_comm_stream.py — the communication stream on a real GPU
(Note [streams] in zerorun/zero/comm/collectives.py; the CPU tests mock it in
tests/unit/test_comm_stream.py).

On one GPU: the stream mechanics with a stand-in for the collective (a copy, or a sleep kernel
and a fill, queued where NCCL would queue its kernel): it reads what the compute stream wrote
before the issue, the consumer reads what it wrote, a buffer dropped after the wait is not
reused under it, the host returns at once and the ledger times it without blocking. On two GPUs: NCCL at world 2
through the engine, stages 2 and 3, against one plain-torch process, with every collective
reported finished with event-timed seconds. No timing assertions: a busy GPU must pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from cuda_harness import FP32_TOLERANCE, MARKS, REPO, STEPS, reference

pytestmark = MARKS

SLEEP_CYCLES = 50_000_000  # tens of ms on any GPU: long enough that the host is surely ahead


def _stand_in(output: torch.Tensor, value: float):
    """What a collective does to the streams: a kernel that takes a while, then writes its output."""
    def call():
        torch.cuda._sleep(SLEEP_CYCLES)
        output.fill_(value)
    return call


def test_the_collective_reads_what_compute_wrote_and_the_consumer_reads_what_it_wrote():
    from zerorun.zero.comm import comm_stream
    from zerorun.zero.comm.event_ledger import EventLedger

    device = torch.device("cuda", torch.cuda.current_device())
    source = torch.zeros(1 << 20, device=device)
    output = torch.zeros(1 << 20, device=device)  # both allocated on the compute stream
    torch.cuda._sleep(SLEEP_CYCLES)
    source.fill_(2.0)  # produced late on the compute stream: the collective must wait for it
    ledger = EventLedger(guard=comm_stream.on_gpu)
    start, end = comm_stream.issue(lambda: output.copy_(source), device)
    ledger.add(0, "stand_in", output.numel() * 4, start, end, lane=device.index)
    assert not end.query()  # the host is ahead of the device: nothing waited for anything
    assert not [p for p in ledger.poll() if p.finished]  # asked, not blocked
    comm_stream.consume(end, device)
    total = output.sum()  # queued on the compute stream after the wait
    assert float(total) == 2.0 * output.numel()  # before: it read the late write; after: we read its
    finished = [p for p in ledger.poll() if p.finished]
    assert len(finished) == 1 and finished[0].seconds >= 0.0
    assert ledger.pending() == 0


def test_a_gather_buffer_dropped_after_wait_is_not_reused_under_the_collective():
    """Note [buffers across streams]: an output allocated on the compute stream, dropped after
    the consumer's wait, and the same memory taken again at once by the compute stream, must
    not be written by the compute stream before the (slow) collective finished."""
    from zerorun.zero.comm import comm_stream

    device = torch.device("cuda", torch.cuda.current_device())
    output = torch.zeros(1 << 20, device=device)
    address = output.data_ptr()
    _, end = comm_stream.issue(_stand_in(output, 1.0), device)
    comm_stream.consume(end, device)
    del output
    again = torch.empty(1 << 20, device=device)  # the caching allocator's freed block, most likely
    again.fill_(5.0)  # queued after the wait: the stand-in's fill of 1.0 happened before
    assert float(again.sum()) == 5.0 * again.numel()
    if again.data_ptr() != address:
        pytest.skip("the allocator gave a different block; the ordering was not exercised")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


RANK_CODE = """
import json, os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.path.join(os.environ["REPO"], "tests", "cuda"))
from cuda_harness import build_model, config, optimizer_for, train
import zerorun
from zerorun.zero.comm import collectives

class Seen:
    def __init__(self):
        self.finished, self.waited, self.started = [], [], []
    def collective_started(self, seq, op, nbytes):
        self.started.append(seq)
    def collective_waited(self, seq, op, waited):
        self.waited.append(waited)
    def collective_finished(self, seq, op, nbytes, seconds, waited):
        self.finished.append((seq, op, seconds, waited))

seen = Seen()
collectives.add_observer(seen)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
model = build_model("cpu")
engine = zerorun.initialize(model, optimizer_for(model), config(int(os.environ["STAGE"])))
assert dist.get_backend() == "nccl" and engine.device == torch.device("cuda", rank), engine.device
losses = train(engine, rank, world)
torch.cuda.synchronize()
collectives.poll_timings()
final = engine.full_state_dict()
if rank == 0:
    torch.save({k: v.cpu() for k, v in final.items()}, os.environ["OUT"])
torch.cuda.synchronize()
collectives.poll_timings()
from zerorun.zero.comm import comm_stream
print(json.dumps({"losses": losses, "finished": seen.finished, "started": seen.started,
                  "waited": seen.waited, "streams": sorted(comm_stream._streams),
                  "pending": collectives._ledger.pending()}))
"""


@pytest.mark.parametrize("stage", [2, 3])
def test_nccl_at_world_2_runs_on_the_comm_stream_and_matches_one_process(stage, tmp_path):
    if _gpus() < 2:
        pytest.skip("needs two GPUs (NCCL refuses two ranks on one GPU)")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "REPO": str(REPO), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533",
           "STAGE": str(stage), "OUT": str(tmp_path / "final.pt")}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_CODE],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))
             for r in range(2)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    for rank, (_, err) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    for rank, result in enumerate(results):
        assert result["streams"] == [rank]  # one communication stream, on this rank's GPU
        assert result["pending"] == 0  # after a synchronize every collective was seen finished
        on_stream = [f for f in result["finished"] if f[1] != "barrier"]  # barrier has no tensor: torch's
        ops = {op for _, op, _, _ in on_stream}
        assert ({"reduce_scatter", "all_gather"} if stage == 3 else {"reduce_scatter"}) <= ops
        assert all(seconds >= 0.0 and waited == 0.0 for _, _, seconds, waited in on_stream)  # event-timed
        assert set(result["started"]) >= {seq for seq, *_ in on_stream}  # begun, then finished
        assert len(result["waited"]) == len(on_stream)  # each waited once; the host's part apart
    assert results[0]["losses"] == results[1]["losses"] and len(results[0]["losses"]) == STEPS
    want = reference(torch.device("cuda", 0))
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(want["losses"]),
                               rtol=FP32_TOLERANCE["rtol"], atol=FP32_TOLERANCE["atol"])
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    for name, value in want["final"].items():
        torch.testing.assert_close(final[name].float(), value, rtol=0.0, atol=1e-4, msg=name)
