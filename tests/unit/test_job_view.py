"""pytest tests/unit/test_job_view.py — node 0's job-wide view under srun (Note [one view under srun]).

The protocol's pure functions, then node 0's ViewServer and another node's ViewForwarder over
a real local socket: what node 1 forwards ends up in node 0's collector and metrics.jsonl as
if node 0's own agent had delivered it, and every failure (no file, a wrong token, node 0
gone) ends in one line and the per-node view, never a hang.
"""

from __future__ import annotations

import io
import json
import os
import socket
import stat
import threading
import time

from zerorun.launch import job_view, job_view_protocol
from zerorun.launch.job_view import JobWideView, NodeView, ViewForwarder, ViewServer
from zerorun.launch.job_view_protocol import (check_hello, merge_event, node_ranks, read_view_file, view_file,
                                              write_view_file)
from zerorun.telemetry import events
from zerorun.ui.live import JobView


def tele(rank: int, kind: str, token: str, **fields) -> bytes:
    return events.encode({"v": 1, "token": token, "rank": rank, "host": f"n{rank + 1}", "kind": kind,
                          "t": time.time(), **fields})


def step(rank: int, token: str, n: int) -> bytes:
    return tele(rank, "step", token, step=n, step_time_s=0.5, samples=4, loss=1.0 + rank, waited_s=0.1)


# --- pure -----------------------------------------------------------------------------------


def test_node_ranks_and_the_file_beside_every_nodes_run_dir(tmp_path):
    assert list(node_ranks(0, 2)) == [0, 1] and list(node_ranks(2, 2)) == [4, 5]
    assert view_file(tmp_path / "slurm-7.0" / "node3") == tmp_path / "slurm-7.0" / "node0" / "job-view.json"
    assert view_file(tmp_path / "slurm-7.0" / "node0") == view_file(tmp_path / "slurm-7.0" / "node1")


def test_the_view_file_is_private_and_checked(tmp_path):
    path = tmp_path / "job-view.json"
    write_view_file(path, 4242, "secret")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # the token is the listener's secret
    assert read_view_file(path) == (4242, "secret")
    assert [p.name for p in tmp_path.iterdir()] == ["job-view.json"]  # no temporary left
    for bad in ('{"port": 0, "token": "x"}', '{"port": 80}', "[1]", "not json"):
        path.write_text(bad)
        try:
            read_view_file(path)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad!r}")


def test_a_hello_must_carry_the_token_and_name_another_node():
    def hello(**fields) -> bytes:
        return job_view_protocol.encode({"t": "hello", **fields})

    assert check_hello(hello(token="tok", node=1), "tok", 3) == 1
    assert check_hello(hello(token="tok", node=2), "tok", 3) == 2
    for line in (hello(token="bad", node=1), hello(token="tok", node=0), hello(token="tok", node=3),
                 hello(token="tok", node=True), hello(token="tok", node="1"), hello(node=1),
                 job_view_protocol.encode({"t": "tel", "token": "tok", "node": 1}), b"junk\n", b"[" * 100000 + b"\n"):
        assert check_hello(line, "tok", 3) is None, line[:80]


def test_forwarded_lines_become_node_0s_events_for_the_senders_ranks_only():
    ranks = node_ranks(1, 2)  # ranks 2 and 3
    kind, line = merge_event(job_view_protocol.encode({"t": "tel", "line": step(3, "node1", 5).decode()}), ranks, "node0")
    record = json.loads(line)
    assert kind == "tel" and record["token"] == "node0" and record["rank"] == 3 and record["step"] == 5
    assert merge_event(job_view_protocol.encode({"t": "exit", "rank": 2, "rc": -9}), ranks, "node0") == ("exit", 2, -9, 0.0, ())
    failed = {"t": "exit", "rank": 3, "rc": 1, "at": 12.5, "tail": ["Traceback", "ValueError: x"]}
    assert merge_event(job_view_protocol.encode(failed), ranks, "node0") == ("exit", 3, 1, 12.5, ("Traceback", "ValueError: x"))
    assert merge_event(job_view_protocol.encode({"t": "done"}), ranks, "node0") == ("done",)
    for event in ({"t": "tel", "line": step(0, "node1", 5).decode()},  # rank 0 is node 0's
                  {"t": "tel", "line": "not json"}, {"t": "tel", "line": 5}, {"t": "exit", "rank": 4, "rc": 0},
                  {"t": "exit", "rank": 2, "rc": "0"}, {"t": "exit", "rank": True, "rc": 0}, {"t": "out", "line": "x"},
                  {"t": "exit", "rank": 2, "rc": 1, "at": "now"}, {"t": "exit", "rank": 2, "rc": 1, "tail": "x"},
                  {"t": "exit", "rank": 2, "rc": 1, "tail": [1]},
                  {"t": "exit", "rank": 2, "rc": 1, "tail": ["x"] * (job_view_protocol.FORWARDED_TAIL_LINES + 1)}):
        assert merge_event(job_view_protocol.encode(event), ranks, "node0") is None, event
    assert merge_event(b"\xff\xfe\n", ranks, "node0") is None


# --- over a socket ----------------------------------------------------------------------------


def node0_view(tmp_path, world_size: int = 2) -> JobView:
    run_dir = tmp_path / "slurm-1.0" / "node0"
    run_dir.mkdir(parents=True)
    return JobView(run_dir=run_dir, token="node0", world_size=world_size, dashboard=False, stream=io.StringIO())


def forwarder(tmp_path, failures: list, node_rank: int = 1, window_s: float = 30.0) -> ViewForwarder:
    return ViewForwarder(path=view_file(tmp_path / "slurm-1.0" / f"node{node_rank}"), host="127.0.0.1",
                         node_rank=node_rank, on_failure=failures.append, connect_window_s=window_s)


def node0_server(tmp_path) -> tuple[JobView, ViewServer]:
    view = node0_view(tmp_path)
    server = ViewServer(view, path=view_file(view.run_dir), nodes=("127.0.0.1", "127.0.0.1"), per_node=1)
    server.start()
    return view, server


def connected(tmp_path):
    """Node 0's view and listener, and node 1's forwarder started towards it."""
    view, server = node0_server(tmp_path)
    failures: list = []
    sender = forwarder(tmp_path, failures)
    sender.start()
    return view, server, sender, failures


def test_node_1s_records_reach_node_0s_collector_and_metrics_file(tmp_path):
    view, server, sender, failures = connected(tmp_path)
    view.on_telemetry("n1", step(0, "node0", 1))  # node 0's own rank
    for n in (1, 2):
        sender.telemetry(step(1, "node1", n))
    sender.telemetry(step(0, "node1", 3))  # node 1 may not speak for rank 0: dropped
    sender.worker_exited(1, 0)
    assert sender.finish() and sender.state == "done" and not failures
    server.wait_for_nodes()
    assert server.done == {1} and server.missing() == {}
    server.close()
    assert not view_file(view.run_dir).exists()  # node 0 removes its file
    ranks = {r.rank: r for r in view.collector.snapshot().ranks}
    assert ranks[1].step == 2 and ranks[1].host == "n2" and ranks[1].exit_code == 0
    assert ranks[1].run_samples_per_s == 8 / 1.0 and ranks[0].step == 1
    assert dict(view.collector.snapshot().dropped)["schema"] == 1
    view.collector.close()
    records = [json.loads(line) for line in (view.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["rank"], r["step"]) for r in records) == [(0, 1), (1, 1), (1, 2)]
    assert all("token" not in r for r in records)


def test_a_wrong_token_is_refused_and_the_node_keeps_its_own_view(tmp_path):
    view, server = node0_server(tmp_path)
    port, _ = read_view_file(server.path)
    write_view_file(server.path, port, "stolen")  # an earlier run's file, say: the hello fails
    failures: list = []
    sender = forwarder(tmp_path, failures, window_s=1.0)
    sender.start()
    sender.telemetry(step(1, "node1", 1))
    started = time.monotonic()
    assert not sender.finish(timeout_s=5.0)
    assert time.monotonic() - started < 8.0
    assert len(failures) == 1 and "refused the hello" in failures[0], failures
    server.close()
    assert view.collector.snapshot().accepted == 0 and server.joined == set()
    assert server.missing() == {1: "it did not connect"}


def test_no_file_fails_once_within_the_window_and_drops_later_events(tmp_path):
    failures: list = []
    sender = forwarder(tmp_path, failures, window_s=0.5)
    sender.start()
    deadline = time.monotonic() + 10
    while not failures and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(failures) == 1 and "did not appear" in failures[0] and "filesystem every node sees" in failures[0]
    sender.telemetry(step(1, "node1", 1))
    assert sender.state == "failed" and not sender.finish(timeout_s=1.0) and len(failures) == 1


def test_a_node_ending_before_it_reached_node_0_says_why_it_did_not(tmp_path):
    failures: list = []
    sender = forwarder(tmp_path, failures, window_s=60.0)
    sender.start()
    time.sleep(0.5)
    started = time.monotonic()
    assert not sender.finish(timeout_s=30.0)
    assert time.monotonic() - started < job_view.DRAIN_UNCONNECTED_S + 2  # a short wait, not the window
    assert len(failures) == 1 and "did not appear" in failures[0], failures


def test_node_0_gone_mid_run_is_one_line_and_never_blocks_the_sender(tmp_path):
    view, server, sender, failures = connected(tmp_path)
    sender.telemetry(step(1, "node1", 1))
    deadline = time.monotonic() + 10
    while view.collector.snapshot().accepted < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.close()  # node 0's launcher ended (or died): its end of every connection closes
    assert list(server.missing()) == [1]  # it never said "done"
    started = time.monotonic()
    while not failures and time.monotonic() - started < 10:
        sender.telemetry(step(1, "node1", 2))  # a send on a reset connection fails within a few tries
        time.sleep(0.05)
    assert len(failures) == 1 and "broke" in failures[0], failures
    assert not sender.finish(timeout_s=2.0)
    sender._thread.join(timeout=5.0)
    assert not sender._thread.is_alive() and not any(t.name == "zerorun-job-view" for t in threading.enumerate())


def test_the_two_views_end_to_end(tmp_path):
    """Node 1's NodeView prints its workers' lines and one closing line; node 0's JobWideView
    has both ranks in its summary."""
    nodes = ("127.0.0.1", "127.0.0.1")
    (tmp_path / "slurm-1.0" / "node1").mkdir(parents=True)
    node0_out, node1_out = io.StringIO(), io.StringIO()
    node0 = JobWideView(run_dir=tmp_path / "slurm-1.0" / "node0", token="node0", world_size=2, dashboard=False,
                        stream=node0_out, nodes=nodes, per_node=1, status_interval_s=0.5)
    node1 = NodeView(run_dir=tmp_path / "slurm-1.0" / "node1", token="node1", world_size=2, dashboard=False,
                     stream=node1_out, nodes=nodes, per_node=1, node_rank=1, status_interval_s=0.5)
    (tmp_path / "slurm-1.0" / "node0").mkdir(parents=True)
    node0.start()
    node1.start()
    node0.on_telemetry("n1", step(0, "node0", 1))
    node1.on_telemetry("n2", step(1, "node1", 1))
    node1.on_output("n2", 1, "hello from rank 1")
    time.sleep(1.2)  # past a status interval: node 1 prints no status line of its own
    node1.on_worker_exit("n2", 1, 0)
    node0.on_worker_exit("n1", 0, 0)
    node1.stop(False)
    node0.stop(False)
    out0, out1 = node0_out.getvalue(), node1_out.getvalue()
    assert "[rank1] hello from rank 1" in out1 and "zerorun summary" not in out1
    assert "samples/s" not in out1  # no status line: node 0's show the job
    assert "zerorun: node 1: its rank 1 is in the job-wide summary in node 0's output (127.0.0.1)" in out1
    assert "zerorun summary" in out0 and "?" not in out0.split("zerorun summary")[1], out0
    assert "job throughput: 16.0 samples/s" in out0  # both ranks: 8 samples/s each


def test_a_node_whose_forwarding_fails_shows_its_own_view(tmp_path, monkeypatch):
    monkeypatch.setattr(job_view, "CONNECT_WINDOW_S", 0.3)
    out = io.StringIO()
    run_dir = tmp_path / "slurm-1.0" / "node1"
    run_dir.mkdir(parents=True)
    view = NodeView(run_dir=run_dir, token="node1", world_size=2, dashboard=False, stream=out,
                    nodes=("127.0.0.1", "127.0.0.1"), per_node=1, node_rank=1)
    view.start()
    view.on_telemetry("n2", step(1, "node1", 1))
    deadline = time.monotonic() + 10
    while view.forwarder.state != "failed" and time.monotonic() < deadline:
        time.sleep(0.05)
    view.on_worker_exit("n2", 1, 0)
    view.stop(False)
    text = out.getvalue()
    assert text.count("no job-wide view on node 0") == 1 and "this node shows its own rank 1" in text
    assert "zerorun summary" in text and "job-wide summary" not in text


def test_the_launcher_picks_the_view_by_its_node_of_the_step():
    from types import SimpleNamespace

    from zerorun.launch.run_job import step_view
    from zerorun.launch.slurm import StepRole

    plan = SimpleNamespace(nodes=[SimpleNamespace(workers=[object(), object()])])
    for role, expected, extra in (
        (None, JobView, {}),
        (StepRole(("n1",), 0, "n1", 20011), JobView, {}),  # one node: its view is the job's
        (StepRole(("n1", "n2"), 0, "n1", 20011), JobWideView, {"nodes": ("n1", "n2"), "per_node": 2}),
        (StepRole(("n1", "n2"), 1, "n1", 20011), NodeView, {"nodes": ("n1", "n2"), "per_node": 2, "node_rank": 1}),
    ):
        got: dict = {}
        assert step_view(SimpleNamespace(step_role=role, plan=plan), JobView, got) is expected
        assert got == extra


# --- the job's root cause (Note [one cause under srun] in job_cause.py) ----------------------

RAISED = ["Traceback (most recent call last):", '  File "train.py", line 9, in <module>',
          "ValueError: bad batch on rank 1"]


def test_the_job_root_cause_is_the_first_failure_of_any_node(tmp_path):
    from zerorun.launch.job_cause import RemoteExit, job_root_cause
    from zerorun.launch.failure_text import format_failure
    from zerorun.launch.supervisor import Failure

    # Node 0's rank 0 failed of rank 1's exit (a collective's peer gone) a moment after rank 1 raised.
    local = (100.4, Failure("n1", 0, "exit code 1", 1, ["RuntimeError: Connection closed by peer"]))
    remote = [RemoteExit(1, "n2", 1, 1, 100.0, tuple(RAISED))]
    cause = job_root_cause(local, remote, tmp_path / "slurm-7.0")
    assert (cause.host, cause.rank, cause.returncode) == ("n2", 1, 1)
    assert cause.reason == f"exit code 1 (its log: {tmp_path}/slurm-7.0/node1/logs/rank1.log, and node 1's output)"
    assert cause.traceback == RAISED and "ValueError: bad batch on rank 1" in format_failure(cause)
    # Node 0's failure first: it stays the cause, and so it does on a tie; no failure at all: None.
    assert job_root_cause(local, [RemoteExit(1, "n2", 1, 1, 100.5)], tmp_path) is local[1]
    assert job_root_cause(local, [RemoteExit(1, "n2", 1, 1, 100.4)], tmp_path) is local[1]
    assert job_root_cause(local, [], tmp_path) is local[1]
    assert job_root_cause(None, [], tmp_path) is None
    # Node 0 ended well but a rank of node 1 failed: that is the job's cause.
    assert job_root_cause(None, remote, tmp_path).rank == 1


def test_a_first_failure_that_names_another_nodes_rank_gives_way_to_it(tmp_path):
    """As the supervisor among local ranks (watchdog.cause_named): the first failure's own
    error names rank 3, on node 1, which failed later; a rank ended by its launcher's stop does not count."""
    from zerorun.launch.job_cause import RemoteExit, job_root_cause
    from zerorun.launch.supervisor import Failure

    named = ["[rank0]: zerorun: error: rank 0: saving the checkpoint failed on rank 3 (its error says why)"]
    local = (50.0, Failure("n1", 0, "exit code 1", 1, named))
    later = RemoteExit(1, "n2", 3, 1, 50.2, tuple(RAISED))
    assert job_root_cause(local, [RemoteExit(1, "n2", 2, 1, 50.1), later], tmp_path).rank == 3
    assert job_root_cause(local, [RemoteExit(1, "n2", 3, -15, 50.2)], tmp_path) is local[1]  # our own stop


def test_node_0_names_the_rank_of_node_1_that_failed_first(tmp_path):
    """Over the real socket: node 1's failed rank 1 reaches node 0 with its last lines; node 0's
    view, whose own rank 0 failed after it, names rank 1 on n2 with its traceback and fails."""
    from zerorun.launch.supervisor import Failure

    nodes = ("127.0.0.1", "127.0.0.1")
    (tmp_path / "slurm-1.0" / "node1").mkdir(parents=True)
    (tmp_path / "slurm-1.0" / "node0").mkdir(parents=True)
    node0_out, node1_out = io.StringIO(), io.StringIO()
    node0 = JobWideView(run_dir=tmp_path / "slurm-1.0" / "node0", token="node0", world_size=2, dashboard=False,
                        stream=node0_out, nodes=nodes, per_node=1)
    node1 = NodeView(run_dir=tmp_path / "slurm-1.0" / "node1", token="node1", world_size=2, dashboard=False,
                     stream=node1_out, nodes=nodes, per_node=1, node_rank=1)
    node0.start()
    node1.start()
    for line in ["step 1", *RAISED]:
        node1.on_output("n2", 1, line)
    node1.on_worker_exit("n2", 1, 1)
    time.sleep(0.05)
    node0.on_worker_exit("n1", 0, 1)
    local = (time.time(), Failure("n1", 0, "exit code 1", 1, ["RuntimeError: Connection closed by peer"]))
    node1.stop(True)
    node0.stop(True)
    cause = node0.job_root_cause(local)
    assert (cause.host, cause.rank) == ("127.0.0.1", 1) and cause.traceback == RAISED, cause
    assert "slurm-1.0/node1/logs/rank1.log" in cause.reason
    assert "zerorun summary (failed" in node0_out.getvalue()


def two_started_nodes(tmp_path):
    """Node 0's job-wide view and node 1's forwarding view of a 2-node srun job, started; and
    node 0's output."""
    nodes = ("127.0.0.1", "127.0.0.1")
    for node in ("node0", "node1"):
        (tmp_path / "slurm-1.0" / node).mkdir(parents=True)
    node0_out = io.StringIO()
    node0 = JobWideView(run_dir=tmp_path / "slurm-1.0" / "node0", token="node0", world_size=2, dashboard=False,
                        stream=node0_out, nodes=nodes, per_node=1)
    node1 = NodeView(run_dir=tmp_path / "slurm-1.0" / "node1", token="node1", world_size=2, dashboard=False,
                     stream=io.StringIO(), nodes=nodes, per_node=1, node_rank=1)
    node0.start()
    node1.start()
    return node0, node1, node0_out


def test_node_0_whose_ranks_ended_well_fails_when_a_rank_of_node_1_failed(tmp_path):
    node0, node1, node0_out = two_started_nodes(tmp_path)
    node1.on_worker_exit("n2", 1, -9)
    node0.on_worker_exit("n1", 0, 0)
    node1.stop(True)
    node0.stop(False)
    cause = node0.job_root_cause(None)
    assert cause is not None and cause.rank == 1 and cause.reason.startswith("signal SIGKILL"), cause
    assert "zerorun summary (failed" in node0_out.getvalue()


def forged_hello(server: ViewServer, node: int) -> bytes:
    """What node 0 answers a second connection that knows the token and claims ``node``, after
    which it sends a failed exit for that node's rank; b"" when it is refused."""
    port, token = read_view_file(server.path)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(job_view_protocol.encode({"t": "hello", "token": token, "node": node}))
        answer = sock.makefile("rb").readline(16)
        if answer == b"ok\n":
            sock.sendall(job_view_protocol.encode({"t": "exit", "rank": node, "rc": 1, "at": time.time(), "tail": ["forged"]}))
            sock.sendall(job_view_protocol.encode({"t": "done"}))
            time.sleep(0.3)  # node 0 reads them before this end closes
        return answer


def test_a_node_joins_once_so_a_token_holder_cannot_forge_its_exit(tmp_path):
    """A second hello for node 1, while it is joined and after it is done, is refused and
    counted; node 1's own clean exit stands, the job succeeds, and node 0 names node 1 once."""
    node0, node1, node0_out = two_started_nodes(tmp_path)
    server = node0.server
    assert server is not None
    deadline = time.monotonic() + 30
    while 1 not in server.joined and time.monotonic() < deadline:
        time.sleep(0.05)
    assert forged_hello(server, 1) == b""  # while node 1 is joined
    node1.on_worker_exit("n2", 1, 0)
    node0.on_worker_exit("n1", 0, 0)
    node1.stop(False)
    server.wait_for_nodes()
    assert server.done == {1}
    assert forged_hello(server, 1) == b""  # after node 1 said "done"
    node0.stop(False)
    assert server.refused == {1: 2} and server.failed == [] and node0.job_root_cause(None) is None
    out = node0_out.getvalue()
    assert out.count("node 1 (127.0.0.1): refused 2 more connection(s) claiming it") == 1, out
    assert "zerorun summary (failed" not in out and "zerorun summary" in out
