"""``zerorun report RUN_DIR [--format png|html] [--out PATH]``: plots from a run's metrics.jsonl.

Draws memory over time per rank, communication time per collective type per rank, and loss /
step time per step, with matplotlib (headless Agg backend). PNG writes one file per plot into
RUN_DIR/report/ (or --out); HTML writes one self-contained page (images inlined, plus a summary
table) to RUN_DIR/report.html (or --out). Reading the file is zerorun.telemetry.metrics.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Optional

import typer

from zerorun.errors import ZerorunError
from zerorun.telemetry.metrics import Metrics, comm_ops, load_records, summarize, throughput

FORMATS = ("png", "html")
MiB = 1 << 20


class ReportError(ZerorunError):
    """``zerorun report`` got a run directory it cannot report on."""


def register(app: typer.Typer) -> None:
    @app.command("report", help="Plot a run's telemetry (memory per rank, communication per op, steps) as PNG or HTML.")
    def report_command(
        run_dir: Path = typer.Argument(..., help="A run directory (the one holding metrics.jsonl)."),
        fmt: str = typer.Option("png", "--format", help="png (one file per plot) or html (one page)."),
        out: Optional[Path] = typer.Option(None, "--out", help="Output folder (png) or file (html)."),
    ) -> None:
        for path in write_report(run_dir, fmt, out):
            typer.echo(str(path))


def write_report(run_dir: Path, fmt: str = "png", out: Path | None = None) -> list[Path]:
    """Write the report; returns the files written. Raises ReportError on bad input."""
    if fmt not in FORMATS:
        raise ReportError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}", hint="use --format png or --format html")
    metrics_path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise ReportError(f"run directory {str(run_dir)!r} does not exist",
                          hint="pass the directory zerorun printed at the start of the run")
    if not metrics_path.is_file():
        raise ReportError(f"{metrics_path} does not exist",
                          hint="telemetry was off for this run, or it ended before any worker reported")
    records, skipped = load_records(metrics_path)
    metrics = summarize(records, skipped)
    if not metrics.ranks:
        raise ReportError(f"{metrics_path} holds no telemetry records ({skipped} unreadable lines)")
    figures = _figures(metrics)
    if fmt == "png":
        folder = out or Path(run_dir) / "report"
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for name, figure in figures.items():
            path = folder / f"{name}.png"
            figure.savefig(path, dpi=100)
            written.append(path)
        _close(figures)
        return written
    path = out or Path(run_dir) / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_html(metrics, figures, run_dir), encoding="utf-8")
    _close(figures)
    return [path]


def _figures(metrics: Metrics) -> dict:
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    from matplotlib.figure import Figure

    figures = {}
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.add_subplot()
    for rank, s in metrics.ranks.items():
        ax.plot(s.mem_t, [b / MiB for b in s.mem_bytes], label=f"rank {rank} ({s.host})")
    labels = {s.mem_label for s in metrics.ranks.values()}
    ax.set(title="Memory over time per rank", xlabel="seconds", ylabel=f"{' / '.join(sorted(labels))} (MiB)")
    ax.legend(loc="best", fontsize="small")
    figures["memory"] = fig

    ops = comm_ops(metrics)
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(metrics.ranks))
    for i, (rank, s) in enumerate(metrics.ranks.items()):
        ax.bar([j + i * width for j in range(len(ops))], [s.comm.get(op, [0, 0, 0])[2] for op in ops],
               width=width, label=f"rank {rank}")
    ax.set_xticks([j + width * (len(metrics.ranks) - 1) / 2 for j in range(len(ops))], ops)
    ax.set(title="Communication time per collective type", ylabel="seconds")
    if ops:
        ax.legend(loc="best", fontsize="small")
    figures["comm"] = fig

    if any(s.steps for s in metrics.ranks.values()):
        fig = Figure(figsize=(8, 5), layout="constrained")
        loss_ax, time_ax = fig.subplots(2, 1, sharex=True)
        for rank, s in metrics.ranks.items():
            points = [(st, lo) for st, lo in zip(s.steps, s.loss) if lo is not None]
            if points:
                loss_ax.plot(*zip(*points), label=f"rank {rank}")
            time_ax.plot(s.steps, s.step_time_s, label=f"rank {rank}")
        loss_ax.set(title="Loss and step time", ylabel="loss")
        time_ax.set(xlabel="step", ylabel="step time (s)")
        time_ax.legend(loc="best", fontsize="small")
        figures["steps"] = fig
    return figures


def _html(metrics: Metrics, figures: dict, run_dir: Path) -> str:
    ops = comm_ops(metrics)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ("rank", "host", "steps", "peak memory (MiB)",
                                                         *(f"{op} (s)" for op in ops), "samples/s"))
    rows = []
    for rank, s in metrics.ranks.items():
        rate = throughput(s)
        cells = [str(rank), html.escape(s.host), str(len(s.steps)), f"{s.mem_peak / MiB:.1f}",
                 *(f"{s.comm[op][2]:.3f}" if op in s.comm else "-" for op in ops),
                 "-" if rate is None else f"{rate:.1f}"]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    images = []
    for name, figure in figures.items():
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=100)
        images.append(f'<h2>{name}</h2><img alt="{name}" src="data:image/png;base64,'
                      f'{base64.b64encode(buffer.getvalue()).decode()}">')
    note = f"<p>{metrics.skipped_lines} unreadable lines skipped.</p>" if metrics.skipped_lines else ""
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>zerorun report</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style></head><body>"
        f"<h1>zerorun report: {html.escape(str(run_dir))}</h1>"
        f"<p>{len(metrics.ranks)} ranks, {metrics.duration_s:.1f} s of telemetry.</p>{note}"
        f"<table><tr>{head}</tr>{''.join(rows)}</table>{''.join(images)}</body></html>"
    )


def _close(figures: dict) -> None:
    figures.clear()  # Figure objects (not pyplot) are freed with their last reference
