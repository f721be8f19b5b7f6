"""pytest -m long tests/e2e/test_link_rate.py — the ring moves bytes at the link's rate between hosts.

Two ranks in two network namespaces joined by a veth pair shaped to 300 Mbit/s each way
(scripts/bench_link.py's link; root and iproute2 needed, skipped with the reason otherwise), no
host channel: an all-gather of 2 x 16.8 MB through the ring driver, each rank sending 16.8 MB
while it receives as much. Note [receives first] (comm/ring.py): when a rank posted its
receive after its send, gloo's go-ahead for the receive waited behind the send's bytes and the
two directions took turns, 145 Mbit/s each (0.93 s); with receives first and the message in
pieces, 286 Mbit/s (0.47 s). The test asks for at least 70% of the rate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_link  # noqa: E402  (scripts/ is not a package)

pytestmark = pytest.mark.long

RATE_BPS = 300e6
ELEMENTS = 4_200_000  # 16.8 MB of fp32 per rank

RANK = r"""
import json, os, sys, time
import torch, torch.distributed as dist
rank, master, iface, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
os.environ["ZERORUN_HOST_CHANNEL"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = iface
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://{master}:29517", rank=rank, world_size=2)
from zerorun.zero.comm import collectives
n = int(sys.argv[5])
shard = torch.full((n,), float(rank))
gathered = torch.empty(2 * n)
collectives.all_gather(gathered, shard, group=None)  # the driver and the connection are up
seconds = []
for _ in range(3):
    dist.barrier()
    started = time.perf_counter()
    collectives.all_gather(gathered, shard, group=None)
    seconds.append(time.perf_counter() - started)
exact = bool(torch.equal(gathered, torch.cat([torch.zeros(n), torch.ones(n)])))
dist.barrier()
with open(out, "w") as f:
    json.dump({"seconds": min(seconds), "exact": exact}, f)
"""


def test_ring_all_gather_moves_at_the_links_rate(tmp_path):
    missing = bench_link.missing_requirements()
    if missing:
        pytest.skip(missing)
    link = bench_link.Link(f"zrt{os.getpid() % 100000}")
    bench_link.create_link(link)
    try:
        bench_link.shape(link, RATE_BPS)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        ranks = [subprocess.Popen(["ip", "netns", "exec", link.namespaces[r], sys.executable, "-c", RANK, str(r),
                                   link.address(0), link.interfaces[r], str(tmp_path / f"rank{r}.json"), str(ELEMENTS)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        for process in ranks:
            _, err = process.communicate(timeout=300)
            assert process.returncode == 0, err[-2000:]
    finally:
        bench_link.delete_link(link)
    for r in range(2):
        result = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert result["exact"], r
        mbit_s = ELEMENTS * 4 * 8 / result["seconds"] / 1e6
        assert mbit_s >= 0.7 * RATE_BPS / 1e6, f"rank {r} sent at {mbit_s:.0f} Mbit/s on a {RATE_BPS / 1e6:.0f} Mbit/s link"
