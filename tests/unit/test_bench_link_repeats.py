"""pytest tests/unit/test_bench_link_repeats.py — scripts/bench_link.py --repeats: a system's row
from its interleaved runs at one rate (the median of their step times, their bytes averaged, the
link bound from those bytes), and a failed run fails the row rather than hiding behind the others."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_link  # noqa: E402  (scripts/ is not a package)


def run(step_s: float, link_bytes: float, told: float | None = None, cpu_s: float = 1.0) -> dict:
    return {"step_s": step_s, "link_bytes": link_bytes, "local_bytes": 0.0, "told_link_bytes": told,
            "last_loss": 7.0, "cpu_s": cpu_s}


def test_a_row_is_the_median_run_and_the_mean_bytes():
    runs = [run(5.5, 164.4e6, 164.0e6, 3.9), run(5.2, 164.6e6, 164.2e6, 3.7), run(5.3, 164.5e6, 164.1e6, 4.0)]
    row = bench_link._link_result("zero3", "300mbit", 300e6, runs, compute_s=3.58, per_host=1, compute_cpu_s=3.5)
    assert row.step_s == 5.3 and row.error is None
    assert row.cpu_s == 3.9 and row.compute_cpu_s == 3.5  # the median run's CPU, the one-host run's
    assert abs(row.link_mb - 164.5) < 1e-9 and abs(row.told_link_mb - 164.1) < 1e-9
    assert abs(row.link_s - 164.5e6 * 8 / 300e6) < 1e-9 and row.compute_s == 3.58


def test_one_failed_run_fails_the_row():
    runs = [run(5.5, 164.4e6), {"error": "rank 1: killed"}, run(5.3, 164.5e6)]
    row = bench_link._link_result("ddp", "1gbit", 1e9, runs, compute_s=None, per_host=2)
    assert row.error == "rank 1: killed" and row.step_s is None


def test_repeats_must_be_at_least_one(capsys):
    try:
        bench_link.parse_args(["--repeats", "0"])
    except SystemExit as stop:
        assert stop.code == 2
    else:
        raise AssertionError("--repeats 0 was accepted")
    assert "--repeats" in capsys.readouterr().err


def test_without_a_compute_run_no_bound_is_claimed():
    """--no-compute: the link time alone is no bound on a step (a 10 Gbit/s row once read 24.68x)."""
    from rich.console import Console

    rows = [bench_link._link_result("zero3", "10gbit", 10e9, [run(5.5, 139.2e6, cpu_s=2.7)], compute_s=None, per_host=2),
            bench_link._link_result("zero3", "1gbit", 1e9, [run(3.2, 164.4e6, cpu_s=2.8)], compute_s=3.0, per_host=1)]
    console = Console(width=250, record=True)
    console.print(bench_link.render(rows, 2, "1.0 -> 2.0"))
    lines = [line for line in console.export_text().splitlines() if "zero3" in line]
    cells = [[cell.strip() for cell in line.split("│")] for line in lines]
    bound_column = ["rate", "system", "step s", "xDDP", "link MB", "xDDP", "zr link MB", "local MB", "link s",
                    "compute s", "step/max(link,compute)"].index("step/max(link,compute)") + 1
    assert cells[0][bound_column] == "-" and cells[0][bound_column + 1] == "2.70"
    assert cells[1][bound_column] == "1.07" and cells[1][bound_column + 1] == "2.80"
