"""pytest tests/unit/test_render_report.py — ``zerorun report``: metrics.jsonl back into series, PNG and HTML."""

from __future__ import annotations


import pytest

from zerorun.cli.main import main
from zerorun.telemetry import events
from zerorun.telemetry.collector import Collector
from zerorun.telemetry.metrics import load_records, summarize, throughput

MiB = 1 << 20


def write_run(run_dir, ranks=2, samples=4):
    collector = Collector(token="T", world_size=ranks, run_dir=run_dir)
    for rank in range(ranks):
        env = {"v": 1, "token": "T", "rank": rank, "host": f"h{rank}"}
        collector.ingest("h", events.encode({**env, "kind": "hello", "t": 100.0, "pid": 1, "world_size": ranks,
                                             "device": "cpu"}))
        for i in range(samples):
            collector.ingest("h", events.encode({
                **env, "kind": "sample", "t": 101.0 + i, "mem": {"rss": (100 + 10 * i + rank) * MiB, "rss_peak": (100 + 10 * i + rank) * MiB},
                "comm": {"all_reduce": [2, 2000, 0.5 * (rank + 1)], "all_gather": [1, 100, 0.25]},
                "comm_seconds_total": 0.0, "entered_seq": 3 * i, "blocked": None}))
            collector.ingest("h", events.encode({**env, "kind": "step", "t": 101.5 + i, "step": i + 1,
                                                 "step_time_s": 0.5, "loss": 2.0 / (i + 1), "samples": 8}))
    collector.close()


def test_summarize_folds_records_per_rank(tmp_path):
    write_run(tmp_path)
    (tmp_path / "metrics.jsonl").open("a").write('{"torn": \n[]\n')
    records, skipped = load_records(tmp_path / "metrics.jsonl")
    metrics = summarize(records, skipped)
    assert skipped == 2 and list(metrics.ranks) == [0, 1]
    r1 = metrics.ranks[1]
    assert r1.host == "h1" and r1.mem_t == [1.0, 2.0, 3.0, 4.0]
    assert r1.mem_bytes == [101 * MiB, 111 * MiB, 121 * MiB, 131 * MiB] and r1.mem_peak == 131 * MiB
    assert r1.comm == {"all_reduce": [8, 8000, 4.0], "all_gather": [4, 400, 1.0]}
    assert r1.steps == [1, 2, 3, 4] and r1.loss[1] == 1.0
    assert throughput(r1) == 32 / 2.0
    assert metrics.duration_s == pytest.approx(4.5)


def test_png_report_through_the_cli(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="PNG plots need the report extra (matplotlib)")
    write_run(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path)])
    assert exit_info.value.code in (0, None)
    written = capsys.readouterr().out.split()
    assert sorted(written) == sorted(str(tmp_path / "report" / f"{n}.png") for n in ("memory", "comm", "steps"))
    for path in written:
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_html_report_is_one_self_contained_page(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="plots in the HTML page need the report extra (matplotlib)")
    write_run(tmp_path, ranks=3)
    out = tmp_path / "out" / "r.html"
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path), "--format", "html", "--out", str(out)])
    page = out.read_text()
    assert page.count("data:image/png;base64,") == 3
    assert "<th>all_gather (s)</th><th>all_reduce (s)</th>" in page
    # rank 2: peak 132 MiB, all_reduce 4 x 1.5 s, 32 samples in 2 s of steps
    assert "<td>2</td><td>h2</td><td>4</td><td>132.0</td><td>-</td><td>1.000</td><td>6.000</td><td>16.0</td>" in page


@pytest.mark.parametrize("setup,args,message", [
    (None, ["--format", "pdf"], "--format 'pdf' is not one of png, html, terminal"),
    ("missing", [], "does not exist"),
    ("empty_dir", [], "metrics.jsonl does not exist"),
    ("garbage", [], "holds no telemetry records (2 unreadable lines)"),
])
def test_bad_input_is_one_line_error(tmp_path, capsys, setup, args, message):
    run_dir = tmp_path / "run"
    if setup != "missing":
        run_dir.mkdir()
    if setup is None:
        write_run(run_dir)
    if setup == "garbage":
        (run_dir / "metrics.jsonl").write_text("not json\n{}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(run_dir), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err
    assert err.startswith("zerorun: error: ")


@pytest.fixture
def no_matplotlib(monkeypatch):
    """This interpreter as after the README's first command (no [report] extra): importing
    matplotlib fails, also where an earlier test imported it."""
    import sys

    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def _report(args, capsys) -> tuple[int, str, str]:
    try:
        main(["report", *args])
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def test_report_without_matplotlib_prints_a_terminal_report(tmp_path, capsys, no_matplotlib):
    """Used to end in a raw ModuleNotFoundError: matplotlib."""
    write_run(tmp_path)
    code, out, err = _report([str(tmp_path)], capsys)
    assert code == 0, err
    assert "Traceback" not in err
    assert "zerorun report" in out and "all_reduce" in out
    assert "loss (rank 0, 2.0000 -> 0.5000)" in out
    assert "pip install 'zerorun[report]'" in err


def test_png_without_matplotlib_names_the_extra_in_one_line(tmp_path, capsys, no_matplotlib):
    write_run(tmp_path)
    code, _, err = _report([str(tmp_path), "--format", "png"], capsys)
    assert code == 2 and "Traceback" not in err
    assert err.splitlines()[0] == ("zerorun: error: PNG plots need matplotlib, which is not installed: "
                                   "pip install 'zerorun[report]'")
    code, _, err = _report([str(tmp_path), "--format", "html"], capsys)
    assert code == 0, err
    assert "No plots: matplotlib is not installed" in (tmp_path / "report.html").read_text()


def test_terminal_format_with_matplotlib_too(tmp_path, capsys):
    write_run(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path), "--format", "terminal"])
    assert exit_info.value.code in (0, None)
    assert "peak" in capsys.readouterr().out


def test_sparkline_spans_low_to_high():
    from zerorun.cli.report import sparkline

    assert sparkline([3.0, 2.0, 1.0]) == "█▅▁"
    assert len(sparkline(list(range(500)))) == 60 and sparkline([]) == ""


def test_the_memory_plot_starts_at_zero(tmp_path):
    """A rank growing from 100 to 131 MiB drawn from 100 up looked like a tripling."""
    pytest.importorskip("matplotlib", reason="plots need the report extra (matplotlib)")
    from zerorun.cli.report import _figures, load_metrics

    write_run(tmp_path)
    figures = _figures(load_metrics(tmp_path))
    low, high = figures["memory"].axes[0].get_ylim()
    assert low == 0 and high >= 131
