"""pytest tests/unit/test_render.py — the dashboard, plain lines and summary, drawn into a recorded console."""

from __future__ import annotations

import io
import json
import re
import time

import pytest
from rich.console import Console

from zerorun.errors import ConfigError
from zerorun.telemetry import events
from zerorun.telemetry.collector import Blocked, CommStat, Hang, RankView, Snapshot
from zerorun.ui.live import JobView
from zerorun.ui.render import bar, fmt_bytes, render, render_plain, render_summary

GiB = 1 << 30


def draw(renderable, width=160) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def snapshot(**overrides) -> Snapshot:
    ranks = (
        RankView(rank=0, host="alpha", device="cuda:0", step=41, mem_label="gpu", mem_used=6 * GiB,
                 mem_peak=7 * GiB, mem_capacity=8 * GiB, comm_fraction=0.42, bandwidth_bps=3.5 * GiB,
                 heartbeat_age_s=0.4, samples_per_s=10.0,
                 comm=(CommStat("all_reduce", 40, 10 * GiB, 2.5), CommStat("broadcast", 1, 1024, 0.01))),
        RankView(rank=1, host="beta", device="cuda:1", step=40, mem_label="gpu", mem_used=2 * GiB,
                 mem_peak=3 * GiB, mem_capacity=8 * GiB, comm_fraction=0.05, bandwidth_bps=1.0 * GiB,
                 heartbeat_age_s=20.0, straggler=True, samples_per_s=9.0,
                 comm=(CommStat("all_reduce", 40, 10 * GiB, 0.5),)),
    )
    base = dict(world_size=2, elapsed_s=3725, ranks=ranks, step=40, total_steps=160, samples_per_s=19.0, run_samples_per_s=19.0,
                output=((0, "epoch 1 loss 2.31"), (1, "warming up")),
                comm_totals=(CommStat("all_reduce", 80, 20 * GiB, 3.0), CommStat("broadcast", 1, 1024, 0.01)))
    base.update(overrides)
    return Snapshot(**base)


def row(text: str, first_cell: str) -> str:
    return next(line for line in text.splitlines() if line.strip("│┃ ").startswith(first_cell + " ")
                and "─" not in line)


def test_dashboard_shows_one_row_per_rank_with_memory_bar_comm_and_heartbeat():
    text = draw(render(snapshot()), width=100)  # a common terminal: nothing may be cut
    assert "…" not in text
    assert "2 ranks" in text and "1:02:05" in text and "step 40/160" in text and "19.0 samples/s" in text
    assert "25%" in text  # 40 of 160 steps
    r0, r1 = row(text, "0"), row(text, "1")
    assert "alpha" in r0 and "41" in r0 and "6.0G/8.0G" in r0 and "mem (gpu)" in text
    assert "██████░░" in r0  # 6 of 8 GiB on an eight-cell bar
    assert "42%" in r0 and "3.5G/s" in r0 and " 0s " in r0 and "slow" not in r0
    assert "beta" in r1 and "██░░░░░░ 2.0G" in r1 and "5%" in r1 and "20s" in r1 and "◀ slow" in r1
    assert "[rank0] epoch 1 loss 2.31" in text and "[rank1] warming up" in text
    assert "HANG" not in text and "dropped" not in text


def test_dashboard_names_ranks_missing_from_a_hung_collective_and_dropped_lines():
    hang = Hang(seq=17, op="all_gather", waited_s=45.2, waiting=(0, 2), missing=(1,))
    blocked = RankView(rank=0, host="a", blocked=Blocked(17, "all_gather", 45.2), heartbeat_age_s=1.0)
    snap = snapshot(hang=hang, ranks=(blocked,), total_steps=None,
                    dropped=(("oversized", 1), ("malformed", 0), ("unauthenticated", 2), ("schema", 0)))
    text = draw(render(snap))
    assert "HANG: rank 1 has not entered collective #17 (all_gather); ranks 0,2 waiting 45s" in text
    assert "in #17 45s" in row(text, "0")
    assert "dropped 3 telemetry lines (1 oversized, 2 unauthenticated)" in text
    assert "%" not in text.splitlines()[1]  # no progress bar without total steps
    all_in = Hang(seq=3, op="barrier", waited_s=31, waiting=(0, 1), missing=())
    assert "entered by every rank but not finished" in draw(render(snapshot(hang=all_in)))


def test_a_rank_not_heard_from_yet_is_starting_and_one_that_exited_unheard_never_reported():
    text = draw(render(Snapshot(world_size=1, elapsed_s=0, ranks=(RankView(rank=0, host="?"),))))
    assert row(text, "0").split() == ["0", "-", "-", "-", "-", "-", "-", "-", "starting"]
    assert render_plain(Snapshot(world_size=1, elapsed_s=0, ranks=(RankView(rank=0, host="?"),))).endswith("r0 starting")
    text = draw(render(Snapshot(world_size=1, elapsed_s=9, ranks=(RankView(rank=0, host="?", exit_code=1),))))
    assert "never" in row(text, "0")


def test_plain_line_and_summary():
    hang = Hang(seq=2, op="all_reduce", waited_s=31, waiting=(0,), missing=(1,))
    line = render_plain(snapshot(hang=hang))
    assert "\x1b" not in line and "\n" not in line
    assert line.startswith("[zerorun] 1:02:05 step 40/160 19.0 samples/s")
    assert "r0 mem 6.0 GiB comm 42%" in line and "r1 mem 2.0 GiB comm 5% STRAGGLER" in line
    assert "rank 1 has not entered collective #2 (all_reduce)" in line

    snap = snapshot()
    with_state = snap.ranks[0].__class__(**{**snap.ranks[0].__dict__, "breakdown": (("params", GiB), ("total", 3 * GiB))})
    text = draw(render_summary(Snapshot(**{**snap.__dict__, "ranks": (with_state, snap.ranks[1])}), failed=True))
    assert "model state" in text and "3.0 GiB" in row(text, "0")
    assert "failed after 1:02:05" in text
    header = next(x for x in text.splitlines() if "peak memory" in x)
    assert "all_reduce s" in header and "broadcast s" in header and "samples/s" in header
    assert "gpu 7.0 GiB" in row(text, "0") and "2.500 (40×)" in row(text, "0") and "0.010 (1×)" in row(text, "0")
    assert "gpu 3.0 GiB" in row(text, "1") and "0.500 (40×)" in row(text, "1")
    assert "job throughput: 19.0 samples/s over the run" in text
    assert "comm wait: share of the run's step time spent blocked on collectives" in text


def test_helpers():
    assert [fmt_bytes(x) for x in (None, 512, 1536, 5 * GiB)] == ["-", "512 B", "1.5 KiB", "5.0 GiB"]
    assert bar(0.5, 4).plain == "██░░" and bar(2.0, 3).plain == "███" and bar(-1, 2).plain == "░░"


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def tele(rank: int, kind: str, token="T", **fields) -> bytes:
    return events.encode({"v": 1, "token": token, "rank": rank, "host": f"h{rank}", "kind": kind, "t": time.time(), **fields})


def test_jobview_plain_mode_prints_output_hangs_and_summary(tmp_path):
    out = io.StringIO()
    view = JobView(run_dir=tmp_path, token="T", world_size=2, dashboard=True, stream=out,
                   hang_after_s=5, status_interval_s=0.5)
    view.start()
    assert not view.live_mode  # StringIO is not a terminal
    view.on_output("h0", 0, "hello from zero")
    view.on_telemetry("h0", tele(0, "sample", mem={"rss": GiB}, comm={}, comm_seconds_total=0.0, entered_seq=7,
                                 blocked={"seq": 7, "op": "all_reduce", "for_s": 9.0}))
    view.on_telemetry("h1", tele(1, "sample", mem={"rss": GiB}, comm={}, comm_seconds_total=0.0, entered_seq=6,
                                 blocked=None))
    view.on_telemetry("h1", tele(1, "step", token="forged", step=1, step_time_s=1.0))
    view.on_telemetry("h1", b"x" * 70_000)
    deadline = time.time() + 10
    while "samples/s" not in out.getvalue() and "mem 1.0 GiB" not in out.getvalue() and time.time() < deadline:
        time.sleep(0.1)
    view.on_worker_exit("h1", 1, 0)
    view.stop(failed=True)
    view.stop(failed=True)  # idempotent
    text = out.getvalue()
    assert "[rank0] hello from zero" in text
    assert "[zerorun] HANG: rank 1 has not entered collective #7 (all_reduce)" in text
    assert "r0 mem 1.0 GiB" in text  # a periodic status line
    assert "zerorun summary (failed" in text and "dropped 2 telemetry lines (1 oversized, 1 unauthenticated)" in text
    assert text.count("HANG: rank 1") >= 2  # the live hang line and the summary
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["rank"] for r in records] == [0, 1]


def test_jobview_on_a_terminal_draws_a_live_dashboard(tmp_path):
    out = FakeTTY()
    view = JobView(run_dir=tmp_path, token="T", world_size=1, dashboard=True, stream=out, total_steps=10)
    view.start()
    assert view.live_mode
    view.on_output("h0", 0, "only in the panel")
    view.on_telemetry("h0", tele(0, "step", step=5, step_time_s=0.5, samples=2))
    view.stop(failed=False)
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out.getvalue())  # drop colours and cursor moves
    assert "│ [rank0] only in the panel" in text  # inside the output panel, not printed raw
    assert "50%" in text and "zerorun summary (finished" in text


def test_jobview_dashboard_off_on_a_terminal_prints_plain_lines(tmp_path):
    out = FakeTTY()
    view = JobView(run_dir=tmp_path, token="T", world_size=1, dashboard=False, stream=out)
    view.start()
    assert not view.live_mode
    view.on_output("h0", 0, "plain")
    view.on_output("h0", -1, "agent says")
    view.stop(failed=False)
    assert out.getvalue().startswith("[rank0] plain\n[zerorun] agent says\n")


@pytest.mark.parametrize("name,value", [("ZERORUN_HANG_AFTER_S", "soon"), ("ZERORUN_TOTAL_STEPS", "-3"),
                                        ("ZERORUN_TOTAL_STEPS", "1.5")])
def test_bad_environment_values_are_user_errors(tmp_path, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        JobView(run_dir=tmp_path, token="T", world_size=1, dashboard=False)


def test_environment_sets_hang_threshold_and_total_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERORUN_HANG_AFTER_S", "2.5")
    monkeypatch.setenv("ZERORUN_TOTAL_STEPS", "300")
    view = JobView(run_dir=tmp_path, token="T", world_size=1, dashboard=False)
    assert (view.collector.hang_after_s, view.collector.total_steps) == (2.5, 300)


def test_config_json_in_the_run_dir_sets_defaults_below_the_environment(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"telemetry": {"total_steps": 50, "hang_after_s": 7.5,
                                                                    "enabled": True, "interval_s": 1.0}}))
    view = JobView(run_dir=tmp_path, token="T", world_size=1, dashboard=False)
    assert (view.collector.total_steps, view.collector.hang_after_s) == (50, 7.5)
    monkeypatch.setenv("ZERORUN_TOTAL_STEPS", "80")
    view = JobView(run_dir=tmp_path, token="T", world_size=1, dashboard=False, hang_after_s=3)
    assert (view.collector.total_steps, view.collector.hang_after_s) == (80, 3)


# --- what a newcomer saw on the CPU demo -------------------------------------------

def cpu_snapshot(**overrides) -> Snapshot:
    """Two CPU ranks as in the README's demo: RSS against a 23 GiB host, losses, step times."""
    MiB = 1 << 20
    ranks = tuple(
        RankView(rank=r, host="localhost", device="cpu", step=12, loss=4.1234 - r * 0.001, mem_label="rss",
                 mem_used=(900 + 100 * r) * MiB, mem_peak=(1000 + 100 * r) * MiB, mem_capacity=23 * GiB,
                 comm_fraction=0.37, bandwidth_bps=512 * MiB, heartbeat_age_s=0.5, step_time_s=0.5,
                 samples_per_s=8.0, blocked=Blocked(seq=1234, op="all_gather", waited_s=3.0))
        for r in range(2))
    base = dict(world_size=2, elapsed_s=6, ranks=ranks, step=12, total_steps=30, samples_per_s=16.0)
    base.update(overrides)
    return Snapshot(**base)


@pytest.mark.parametrize("make", [snapshot, cpu_snapshot])
def test_dashboard_fits_80_columns_without_cut_cells(make):
    text = draw(render(make()), width=80)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    header = next(line for line in text.splitlines() if line.lstrip().startswith("rank"))
    for name in ("rank", "host", "step", "loss", "mem", "peak", "comm", "bw", "seen"):
        assert name in header, name


def test_dashboard_has_a_loss_column():
    text = draw(render(cpu_snapshot()), width=80)
    assert "4.123" in row(text, "0") and "4.122" in row(text, "1")


def test_eta_from_total_steps_and_the_slowest_step_time():
    snap = cpu_snapshot()  # 18 steps left at 0.5 s
    text = draw(render(snap), width=80)
    assert "40%  ETA 0:00:09" in text
    assert "ETA 0:00:09" in render_plain(snap)
    assert "ETA" not in draw(render(cpu_snapshot(total_steps=None)), width=80)


def test_cpu_memory_bar_is_scaled_to_the_jobs_peak_not_the_host():
    text = draw(render(cpu_snapshot()), width=80)
    # against the job's largest peak (1100 MiB): 900 MiB is 6.5 cells of 8, 1000 MiB 7.3; against
    # the 23 GiB host both bars were empty
    assert "███████░ 900M" in row(text, "0") and "███████░ 1.0G" in row(text, "1")
    assert "/23.0G" not in text  # no host capacity on the bar


def test_straggler_is_not_tagged_when_a_hang_names_another_rank():
    """Once showed rank 0 STRAGGLER while the hang line rightly named rank 1."""
    hang = Hang(seq=7, op="all_reduce", waited_s=40, waiting=(0,), missing=(1,))
    ranks = (RankView(rank=0, host="a", straggler=True, comm_fraction=0.1, heartbeat_age_s=1),
             RankView(rank=1, host="b", straggler=True, comm_fraction=0.0, heartbeat_age_s=1))
    snap = Snapshot(world_size=2, elapsed_s=60, ranks=ranks, hang=hang)
    text = draw(render(snap), width=80)
    assert "slow" not in row(text, "0") and "◀ slow" in row(text, "1")
    line = render_plain(snap)
    assert "r0 mem - comm 10% |" in line and "r1 mem - comm 0% STRAGGLER" in line
    every_rank_in = Hang(seq=7, op="all_reduce", waited_s=40, waiting=(0, 1), missing=())
    assert "slow" not in draw(render(Snapshot(world_size=2, elapsed_s=60, ranks=ranks, hang=every_rank_in)))


def test_total_steps_from_set_total_steps_reach_the_progress_bar():
    from zerorun.telemetry.collector import Collector

    collector = Collector(token="T", world_size=1)
    env = {"v": 1, "token": "T", "rank": 0, "host": "h"}
    assert collector.ingest("h", events.encode({**env, "kind": "step", "t": 1.0, "step": 3, "step_time_s": 0.5,
                                                "loss": 2.0, "total_steps": 30}))
    snap = collector.snapshot()
    assert snap.total_steps == 30
    assert "10%  ETA 0:00:13" in draw(render(snap), width=80)  # 27 steps left at 0.5 s
    launcher_known = Collector(token="T", world_size=1, total_steps=50)
    launcher_known.ingest("h", events.encode({**env, "kind": "step", "t": 1.0, "step": 3, "step_time_s": 0.5,
                                              "total_steps": 30}))
    assert launcher_known.snapshot().total_steps == 50  # the launcher's setting (config/env) wins


def test_summary_fits_80_columns_with_three_collective_types():
    """At 80 columns the one-column-per-collective summary was cut to 'all_gat…', 'loca…'."""
    ranks = tuple(RankView(rank=r, host="localhost", step=30, mem_label="rss", mem_peak=358 << 20,
                           samples_per_s=32.7, run_samples_per_s=31.9, run_comm_fraction=0.62,
                           breakdown=(("total", 14 << 20),),
                           comm=(CommStat("all_gather", 242, 1 << 30, 3.2 + r), CommStat("all_reduce", 30, 1 << 20, 0.1),
                                 CommStat("reduce_scatter", 150, 1 << 30, 2.9)))
                  for r in range(2))
    snap = Snapshot(world_size=2, elapsed_s=12, ranks=ranks, samples_per_s=65.3,
                    comm_totals=(CommStat("all_gather", 484, 2 << 30, 7.4), CommStat("all_reduce", 60, 2 << 20, 0.2),
                                 CommStat("reduce_scatter", 300, 2 << 30, 5.8)))
    narrow = draw(render_summary(snap), width=80)
    assert "…" not in narrow and max(len(x) for x in narrow.splitlines()) <= 80
    assert "localhost" in row(narrow, "0") and "rss 358M" in row(narrow, "0") and "62%" in row(narrow, "0")
    assert "31.9" in row(narrow, "0") and "32.7" not in narrow  # the run's rate, not the last steps'
    assert "all_gather" in narrow and "484×" in narrow and "7.400" in narrow and "3.200-4.200" in narrow
    wide = draw(render_summary(snap), width=160)  # room enough: one column per collective, as before
    assert "all_gather s" in wide and "3.200 (242×)" in row(wide, "0")


def test_summary_shows_offloaded_host_and_nvme_bytes_apart_from_model_state():
    breakdown = (("total", 14 << 20), ("offloaded_host", 48 << 20), ("offloaded_nvme", 96 << 20))
    ranks = tuple(RankView(rank=r, host="localhost", step=3, mem_label="rss", mem_peak=358 << 20,
                           samples_per_s=3.0, breakdown=breakdown, comm=()) for r in range(2))
    snap = Snapshot(world_size=2, elapsed_s=5, ranks=ranks, samples_per_s=6.0, comm_totals=())
    narrow = draw(render_summary(snap), width=80)
    assert "rank 0 host 48.0M nvme 96.0M" in narrow and max(len(x) for x in narrow.splitlines()) <= 80
    wide = draw(render_summary(snap), width=160)
    assert "offloaded" in wide and "host 48.0M nvme 96.0M" in row(wide, "0")
    plain = (RankView(rank=0, host="h", step=3, mem_label="rss", mem_peak=1 << 20, samples_per_s=1.0,
                      breakdown=(("total", 1 << 20), ("offloaded_host", 0), ("offloaded_nvme", 0)), comm=()),)
    assert "offloaded" not in draw(render_summary(Snapshot(world_size=1, elapsed_s=1, ranks=plain, samples_per_s=1.0,
                                                            comm_totals=())), width=80)


def test_after_ctrl_c_the_summary_says_interrupted_and_ranks_show_the_signal(tmp_path):
    """The summary said 'failed' and each rank 'exit -15' after the user's own Ctrl-C."""
    out = io.StringIO()
    view = JobView(run_dir=tmp_path, token="T", world_size=2, dashboard=False, stream=out)
    view.start()
    view.on_telemetry("h0", tele(0, "step", step=1, step_time_s=0.5, samples=2))
    for rank in range(2):
        view.on_worker_exit("h0", rank, -15)
    snapshot = view.collector.snapshot()
    view.stop(failed=False, interrupted=True)
    assert "zerorun summary (interrupted after" in out.getvalue() and "failed" not in out.getvalue()
    assert "SIGTERM" in row(draw(render(snapshot)), "0") and "exit -15" not in draw(render(snapshot))
    assert "(failed after" in draw(render_summary(snapshot, failed=True, interrupted=True))
