"""pytest tests/unit/test_collector.py — the launcher-side collector: what it accepts, drops and concludes."""

from __future__ import annotations

import json
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from zerorun.telemetry import events
from zerorun.telemetry.collector import (
    Blocked,
    Collector,
    RankView,
    comm_fraction,
    detect_hang,
    find_stragglers,
)

TOKEN = "s3cret-token"


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def msg(kind: str, rank: int = 0, t: float = 1000.0, token: str = TOKEN, **fields) -> dict:
    return {"v": 1, "token": token, "rank": rank, "host": f"node{rank}", "kind": kind, "t": t, **fields}


def sample(rank=0, t=1000.0, rss=1 << 30, comm=None, comm_total=0.0, entered=-1, blocked=None, **mem):
    return msg("sample", rank, t, mem={"rss": rss, "rss_peak": rss, **mem}, comm=comm or {},
               comm_seconds_total=comm_total, entered_seq=entered, blocked=blocked)


def line(message: dict) -> bytes:
    return events.encode(message)


def test_valid_messages_are_applied_and_written_without_token(tmp_path):
    c = Collector(token=TOKEN, world_size=2, run_dir=tmp_path)
    assert c.ingest("node0", line(msg("hello", 0, pid=1, world_size=2, device="cpu", host_total_bytes=8 << 30)))
    assert c.ingest("node0", line({**sample(0, comm={"all_reduce": [3, 3000, 0.5]}, comm_total=0.5),
                                   "breakdown": {"parameters": 100.0, "total": 300.0}}))
    assert c.ingest("node1", line(msg("step", 1, step=7, step_time_s=0.25, loss=2.5, samples=8)))
    c.close()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["hello", "sample", "step"]
    assert [r["rank"] for r in records] == [0, 0, 1]
    assert all("token" not in r for r in records)
    assert TOKEN not in (tmp_path / "metrics.jsonl").read_text()

    snap = c.snapshot()
    r0, r1 = snap.ranks
    assert (r0.mem_used, r0.mem_capacity, r0.mem_label) == (1 << 30, 8 << 30, "rss")
    assert r0.comm[0].op == "all_reduce" and r0.comm[0].count == 3
    assert r0.bandwidth_bps == 3000 / 0.5
    assert dict(r0.breakdown) == {"parameters": 100.0, "total": 300.0}
    assert (r1.step, r1.loss, r1.samples_per_s) == (7, 2.5, 8 / 0.25)
    assert snap.accepted == 3 and sum(n for _, n in snap.dropped) == 0


def test_bad_input_is_counted_by_reason_and_the_run_goes_on(tmp_path):
    c = Collector(token=TOKEN, world_size=2, run_dir=tmp_path)
    bad = {
        "oversized": [line(sample(0))[:-1] + b" " * (events.MAX_LINE_BYTES + 1)],
        "malformed": [b"not json", b"\xff\xfe\x00garbage", b"[1, 2, 3]", pickle.dumps({"rank": 0}),
                      b'{"v":1,"token":"' + TOKEN.encode() + b'"', b"[" * 60_000],
        "unauthenticated": [line({**sample(0), "token": "wrong"}), line({k: v for k, v in sample(0).items() if k != "token"}),
                            json.dumps({**sample(0), "token": 12345}).encode(),
                            line({**sample(0), "token": TOKEN + "x"})],
        "schema": [line(sample(rank=2)), line(sample(rank=-1)), line(msg("explode", 0)),
                   line({**sample(0), "rank": True}), line({**sample(0), "v": 2}),
                   line(msg("step", 0, step="7", step_time_s=0.1)),
                   json.dumps(msg("step", 0, step=1, step_time_s=float("nan"))).encode(),
                   line({**sample(0), "comm": {"all_reduce": [1, -5, 0.1]}}),
                   line({**sample(0), "mem": {"rss": "lots"}}),
                   line({**sample(0), "t": 10**400}), line({**sample(0), "entered_seq": 2**70}),
                   line(msg("step", 0, step=1, step_time_s=0.1, loss=-(10**309)))],
    }
    for reason, lines in bad.items():
        for raw in lines:
            assert c.ingest("node0", raw) is False, (reason, raw[:80])
    assert c.ingest("node0", line(sample(0, rss=123)))  # a good line after all that junk
    snap = c.snapshot()
    dropped = dict(snap.dropped)
    assert dropped == {reason: len(lines) for reason, lines in bad.items()}
    assert snap.accepted == 1 and snap.ranks[0].mem_used == 123
    c.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512) | st.text(max_size=512).map(str.encode))
def test_fuzzed_bytes_never_raise_and_never_pass_without_the_token(raw):
    c = Collector(token=TOKEN, world_size=2)
    assert c.ingest("x", raw) is False


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "rank", "host", "kind", "t", "mem", "comm", "step", "blocked",
                                         "entered_seq", "comm_seconds_total", "step_time_s"]),
                       st.none() | st.booleans() | st.integers() | st.integers(min_value=2**62, max_value=10**400)
                       | st.floats() | st.text(max_size=5)
                       | st.lists(st.integers(), max_size=3) | st.dictionaries(st.text(max_size=3), st.integers())))
def test_fuzzed_authenticated_objects_never_raise(fields):
    c = Collector(token=TOKEN, world_size=2)
    c.ingest("x", json.dumps({**fields, "token": TOKEN}).encode())
    c.snapshot()  # whatever was accepted must still render into a snapshot


def test_heartbeat_age_blocked_time_and_hang_use_the_collector_clock():
    clock = FakeClock(100.0)
    c = Collector(token=TOKEN, world_size=3, hang_after_s=30, clock=clock)
    c.ingest("n", line(sample(0, entered=12, blocked={"seq": 12, "op": "all_reduce", "for_s": 5.0})))
    c.ingest("n", line(sample(1, entered=11)))
    c.ingest("n", line(sample(2, entered=12, blocked={"seq": 12, "op": "all_reduce", "for_s": 4.0})))
    assert c.snapshot().hang is None
    clock.now += 26.0  # rank 0 has now waited 31 s
    snap = c.snapshot()
    assert snap.ranks[0].heartbeat_age_s == 26.0
    assert snap.ranks[0].blocked == Blocked(12, "all_reduce", 31.0)
    assert snap.hang is not None
    assert (snap.hang.seq, snap.hang.op, snap.hang.missing, snap.hang.waiting) == (12, "all_reduce", (1,), (0, 2))
    assert snap.ranks[1].straggler and not snap.ranks[0].straggler
    c.worker_exited(1, -9)
    assert c.snapshot().ranks[1].exit_code == -9 and not c.snapshot().ranks[1].straggler


def test_throughput_is_the_sum_over_ranks_and_step_is_the_slowest_rank():
    c = Collector(token=TOKEN, world_size=2, total_steps=100)
    for step in range(1, 5):
        c.ingest("n", line(msg("step", 0, step=step, step_time_s=0.5, samples=4, tokens=400)))
    for step in range(1, 4):
        c.ingest("n", line(msg("step", 1, step=step, step_time_s=0.25, samples=4, tokens=400)))
    snap = c.snapshot()
    assert snap.step == 3 and snap.total_steps == 100
    assert snap.samples_per_s == 4 / 0.5 + 4 / 0.25
    assert snap.tokens_per_s == 400 / 0.5 + 400 / 0.25
    assert snap.ranks[0].step_time_s == 0.5


def test_output_lines_are_kept_in_order_and_bounded():
    c = Collector(token=TOKEN, world_size=2, output_lines=5)
    for i in range(12):
        c.add_output(i % 2, f"line {i}")
    assert c.snapshot(output_lines=3).output == ((1, "line 9"), (0, "line 10"), (1, "line 11"))
    assert len(c.snapshot(output_lines=50).output) == 5


def test_comm_fraction_is_waited_time_over_step_time():
    assert comm_fraction([]) is None
    assert comm_fraction([(1.0, 0.25), (1.0, None)]) is None  # a step that did not say
    assert comm_fraction([(1.0, 0.25), (3.0, 0.75)]) == 0.25
    assert comm_fraction([(1.0, 1.5)]) == 1.0  # clamped: never above the step's time


def view(rank, step=None, share=None, entered=None, blocked=None) -> RankView:
    return RankView(rank=rank, host="h", step=step, comm_fraction=share, entered_seq=entered, blocked=blocked)


def test_stragglers_are_the_ranks_others_wait_for_or_that_lag_behind():
    assert find_stragglers([view(0, 10, 0.5)]) == set()
    assert find_stragglers([view(0, 10, 0.40), view(1, 10, 0.45), view(2, 10, 0.42)]) == set()
    assert find_stragglers([view(0, 10, 0.40), view(1, 10, 0.05), view(2, 10, 0.42)]) == {1}
    assert find_stragglers([view(0, 10, 0.50), view(1, 10, 0.10)]) == {1}
    assert find_stragglers([view(0, 10), view(1, 7), view(2, 9)]) == {1}


def test_detect_hang_names_ranks_that_did_not_enter_the_collective():
    waiting = Blocked(seq=5, op="reduce_scatter", waited_s=40.0)
    ranks = [view(0, entered=5, blocked=waiting), view(1, entered=4), view(2, entered=None),
             view(3, entered=5, blocked=Blocked(5, "reduce_scatter", 12.0))]
    hang = detect_hang(ranks, hang_after_s=30.0)
    assert (hang.seq, hang.op, hang.waited_s) == (5, "reduce_scatter", 40.0)
    assert hang.missing == (1, 2) and hang.waiting == (0, 3)
    assert detect_hang(ranks, hang_after_s=60.0) is None
    # Everyone entered but nobody finished: a hang with no one to blame.
    all_in = [view(0, entered=5, blocked=waiting), view(1, entered=5, blocked=waiting)]
    assert detect_hang(all_in, 30.0).missing == ()


def test_control_characters_never_reach_the_state_or_the_file(tmp_path):
    collector = Collector(token=TOKEN, world_size=1, run_dir=tmp_path)
    record = msg("sample", mem={"rss": 1}, comm={"ev\x1b[2Jil\x9b1m\x07": [1, 8, 0.5]}, comm_seconds_total=0.5,
                 entered_seq=0, blocked=None)
    record["host"] = "h\x1b]0;title\x07ost"
    assert collector.ingest("h", json.dumps(record))
    view = collector.snapshot().ranks[0]
    assert view.host == "host" and [c.op for c in view.comm] == ["evil"]
    assert "\\u001b" not in (tmp_path / "metrics.jsonl").read_text()


def test_drops_counted_by_the_agent_show_with_the_rest():
    collector = Collector(token=TOKEN, world_size=1)
    collector.count_dropped("oversized", 2)
    assert dict(collector.snapshot().dropped)["oversized"] == 2


def test_rates_go_blank_when_steps_stop_for_longer_than_a_hang():
    clock = FakeClock()
    collector = Collector(token=TOKEN, world_size=1, hang_after_s=30.0, clock=clock)
    collector.ingest("h", json.dumps(msg("step", step=1, step_time_s=0.5, samples=4)))
    assert collector.snapshot().samples_per_s == 8.0
    clock.now += 31.0
    assert collector.snapshot().samples_per_s is None
    collector.worker_exited(0, 0)  # the summary after the run shows what the rank did
    assert collector.snapshot().samples_per_s == 8.0


def test_a_straggler_is_tagged_only_when_its_lag_lasts():
    """Note [a lag that lasts]: steps arrive in per-rank bursts once a second, so a healthy rank's
    step trails by two or more now and then; only a lag that persists is a straggler."""
    clock = FakeClock(100.0)
    c = Collector(token=TOKEN, world_size=2, clock=clock)

    def steps(rank, upto):
        for n in range(1, upto + 1):
            c.ingest("n", line(msg("step", rank, step=n, step_time_s=0.01, samples=4)))

    steps(0, 40)
    steps(1, 37)  # rank 1's burst for the last second has not arrived yet
    assert not any(r.straggler for r in c.snapshot().ranks)
    clock.now += 1.0
    steps(1, 40)  # it arrives: level again, and the earlier lag is forgotten
    assert not any(r.straggler for r in c.snapshot().ranks)
    clock.now += 1.0
    for second in range(6):  # rank 1 really falls behind, and stays behind
        steps(0, 60 + 20 * second)
        steps(1, 45 + 10 * second)
        clock.now += 1.0
        tagged = c.snapshot().ranks[1].straggler
        assert tagged == (second >= 5), second
