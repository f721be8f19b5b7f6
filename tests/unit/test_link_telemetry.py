"""pytest tests/unit/test_link_telemetry.py — bytes sent per step on each link class, from the
collectives' reports to the screen (Note [bytes per link] in zerorun/telemetry/recorder.py).

The recorder turns each collective's ``collective_sent`` into per-step ``sent_within`` /
``sent_between`` on the step records and running totals on the samples (old fields unchanged);
the collector takes the median per step (the first step also carries initialize's broadcast);
the dashboard shows a line under its table that fits 80 columns, the plain line and the
end-of-run summary a cell per rank (``within|between``), and ``zerorun report`` the same figures
in its terminal table, its HTML table and a PNG plot.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import replace

import pytest
from rich.console import Console

from zerorun.cli.main import main
from zerorun.telemetry import events
from zerorun.telemetry.collector import Collector, RankView, Snapshot, sent_per_step
from zerorun.telemetry.metrics import load_records, sent_per_step as series_sent, summarize
from zerorun.telemetry.recorder import PipeWriter, Recorder
from zerorun.ui.render import render, render_plain, render_summary, sent_line
from zerorun.zero.comm import collectives
from zerorun.zero.comm.link_split import Sent

TOKEN = "tok"
MiB = 1 << 20


def draw(renderable, width: int) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def sent(op: str, within: int, between: int) -> None:
    seq = collectives.next_sequence()
    collectives.notify_sent(seq, op, Sent(within, between))
    collectives.notify_started(seq, op, within + between)
    collectives.notify_finished(seq, op, within + between, 0.001, 0.001)


def recorded_run(tmp_path, rank: int = 0) -> list[bytes]:
    """A rank that broadcasts its model, then takes three steps of 4 MiB within and 6 MiB between."""
    read_fd, write_fd = os.pipe()
    try:
        rec = Recorder(PipeWriter(write_fd), token=TOKEN, rank=rank, host=f"h{rank}", world_size=2, interval_s=60)
        rec.start()
        try:
            sent("broadcast", 0, 50 * MiB)  # initialize's: lands in the first step
            for step in range(1, 4):
                sent("reduce_scatter", 4 * MiB, 0)
                sent("all_gather", 0, 6 * MiB)
                rec.record_step(step=step, step_time_s=0.5, samples=4, loss=1.0)
            rec.send_sample()
        finally:
            rec.close()
        os.set_blocking(read_fd, False)
        data = b""
        try:
            while chunk := os.read(read_fd, 1 << 20):
                data += chunk
        except BlockingIOError:
            pass
        return data.splitlines()
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_steps_carry_what_was_sent_since_the_last_step_and_samples_the_totals(tmp_path):
    messages = [json.loads(x) for x in recorded_run(tmp_path)]
    steps = [m for m in messages if m["kind"] == "step"]
    assert [(m["sent_within"], m["sent_between"]) for m in steps] == [
        (4 * MiB, 56 * MiB), (4 * MiB, 6 * MiB), (4 * MiB, 6 * MiB)]
    samples = [m for m in messages if m["kind"] == "sample"]
    assert samples[-1]["sent"] == [12 * MiB, 68 * MiB]
    assert samples[0]["comm"]["all_gather"][:2] == [3, 18 * MiB]  # the old per-op figures stay


def test_the_schema_takes_byte_counts_only():
    env = {"v": 1, "rank": 0, "host": "h", "t": 1.0}
    step = {**env, "kind": "step", "step": 1, "step_time_s": 0.1}
    events.validate({**step, "sent_within": 5, "sent_between": 0}, 1)
    events.validate(step, 1)  # an older worker's step: no sent fields
    for bad in (-1, 1.5, "5", True):
        with pytest.raises(events.SchemaError):
            events.validate({**step, "sent_between": bad}, 1)
    sample = {**env, "kind": "sample", "mem": {}, "comm": {}, "comm_seconds_total": 0.0, "entered_seq": -1}
    events.validate({**sample, "sent": [1, 2]}, 1)
    for bad in ([1], [1, -2], [1, 2.5], {"within": 1}):
        with pytest.raises(events.SchemaError):
            events.validate({**sample, "sent": bad}, 1)


def test_the_collector_takes_the_median_step_and_the_report_the_same(tmp_path, capsys):
    collector = Collector(token=TOKEN, world_size=2, run_dir=tmp_path)
    for rank in (0, 1):
        assert all(collector.ingest(f"h{rank}", line) for line in recorded_run(tmp_path, rank))
    collector.close()
    snap = collector.snapshot()
    for view in snap.ranks:
        assert view.run_sent_per_step == (4 * MiB, 6 * MiB)  # not the first step's 56 MiB
    assert sent_per_step([]) is None
    assert sent_per_step([(1, 10), (3, 0), (2, 5)]) == (2, 5)

    metrics = summarize(*load_records(tmp_path / "metrics.jsonl"))
    assert series_sent(metrics.ranks[1]) == (4 * MiB, 6 * MiB)
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path), "--format", "terminal"])
    out = capsys.readouterr().out
    assert "sent/step" in out and "4.0M|6.0M" in out
    assert max(len(x) for x in out.splitlines()) <= 80
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path), "--format", "html"])
    page = (tmp_path / "report.html").read_text()
    assert "sent/step between hosts (MiB)" in page and "<td>4.00</td><td>6.00</td>" in page


def test_the_png_report_plots_the_bytes_per_link(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="PNG plots need the report extra (matplotlib)")
    collector = Collector(token=TOKEN, world_size=1, run_dir=tmp_path)
    assert all(collector.ingest("h0", line) for line in recorded_run(tmp_path))
    collector.close()
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path), "--format", "png"])
    assert str(tmp_path / "report" / "link.png") in capsys.readouterr().out.split()


def views(ranks: int, **fields) -> tuple[RankView, ...]:
    return tuple(RankView(rank=r, host="a-long-hostname", step=9, loss=2.0, mem_used=900 * MiB, mem_peak=1 << 30,
                          comm_fraction=0.3, bandwidth_bps=1e8, heartbeat_age_s=0.5, step_time_s=0.5,
                          breakdown=(("total", 300 * MiB),), run_comm_fraction=0.3, run_samples_per_s=8.0,
                          **fields(r) if callable(fields) else fields) for r in range(ranks))


def test_the_dashboard_line_the_plain_line_and_the_summary_fit_80_columns():
    def of(r):
        return {"sent_per_step": (96 * MiB, 48 * MiB * (r % 2)), "run_sent_per_step": (96 * MiB, 48 * MiB * (r % 2))}

    snap = Snapshot(world_size=4, elapsed_s=9, ranks=tuple(
        RankView(rank=r, host="a-long-hostname", step=9, loss=2.0, mem_used=900 * MiB, mem_peak=1 << 30,
                 comm_fraction=0.3, bandwidth_bps=1e8, heartbeat_age_s=0.5, step_time_s=0.5,
                 breakdown=(("total", 300 * MiB),), run_comm_fraction=0.3, run_samples_per_s=8.0, **of(r))
        for r in range(4)), step=9)
    dashboard = draw(render(snap), 80)
    assert "sent/step within|between hosts: r0=96.0M|0B  r1=96.0M|48.0M  r2=96.0M|0B" in dashboard
    assert "r3=96.0M|48.0M" in dashboard.rstrip().splitlines()[-1]  # wrapped between ranks, never inside one
    assert max(len(x) for x in dashboard.splitlines()) <= 80 and "…" not in dashboard
    assert "r1 mem 900.0 MiB own loss 2 comm 30% sent/step 96.0M|48.0M" in render_plain(snap)
    for width in (80, 200):  # the narrow summary (model state included) and the wide one
        summary = draw(render_summary(snap), width)
        assert "…" not in summary and max(len(x) for x in summary.splitlines()) <= width
        assert "sent/step within|between hosts: r0=96.0M|0B  r1=96.0M|48.0M" in summary


def test_many_ranks_give_each_class_its_range_and_no_step_says_nothing():
    ranks = tuple(RankView(rank=r, host="h", sent_per_step=(r * MiB, 0)) for r in range(1, 11))
    line = sent_line(Snapshot(world_size=10, elapsed_s=1, ranks=ranks))
    assert line == "sent/step within|between hosts, 10 ranks: 1.0M-10.0M|0B-0B"
    quiet = Snapshot(world_size=2, elapsed_s=1, ranks=tuple(RankView(rank=r, host="h") for r in range(2)))
    assert sent_line(quiet) == "" and "sent/step" not in draw(render(quiet), 80)
    assert "sent/step" not in draw(render_summary(quiet), 80)
    assert "sent/step" not in render_plain(replace(quiet))
