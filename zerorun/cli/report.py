"""``zerorun report RUN_DIR [--format png|html|terminal] [--out PATH]``: a run's metrics.jsonl, reported.

Draws memory over time per rank, communication time per collective type per rank, the bytes each
rank sent per step within its host and between hosts, and loss / step time per step, with matplotlib (headless Agg backend). PNG writes one file per plot into
RUN_DIR/report/ (or --out); HTML writes one self-contained page (images inlined, plus a summary
table) to RUN_DIR/report.html (or --out); terminal prints the summary and a loss trace with Rich.

matplotlib is optional (``pip install 'zerorun[report]'``): without it the default format is
terminal, HTML has the table but no plots, and ``--format png`` says which extra to install.
Reading the file is zerorun.telemetry.metrics.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Optional

import typer

from zerorun.errors import ZerorunError
from zerorun.telemetry.metrics import (Metrics, comm_ops, comm_share, load_records, mean_last_loss, sent_per_step,
                                       summarize, throughput)

FORMATS = ("png", "html", "terminal")
INSTALL_HINT = "pip install 'zerorun[report]'"
MiB = 1 << 20


class ReportError(ZerorunError):
    """``zerorun report`` got a run directory it cannot report on."""


def register(app: typer.Typer) -> None:
    @app.command("report", help="Plot a run's telemetry (memory per rank, communication per op, steps) as PNG or HTML.")
    def report_command(
        run_dir: Path = typer.Argument(..., help="A run directory (the one holding metrics.jsonl)."),
        fmt: Optional[str] = typer.Option(None, "--format", help="png (one file per plot), html (one page) or "
                                          "terminal; default png, or terminal without matplotlib."),
        out: Optional[Path] = typer.Option(None, "--out", help="Output folder (png) or file (html)."),
    ) -> None:
        if fmt is None:
            fmt = "png" if has_matplotlib() else "terminal"
        if fmt == "terminal":
            from rich.console import Console

            Console(highlight=False).print(terminal_report(load_metrics(run_dir), run_dir))
            if not has_matplotlib():
                typer.echo(f"zerorun: note: matplotlib is not installed; {INSTALL_HINT} for PNG/HTML plots", err=True)
            return
        for path in write_report(run_dir, fmt, out):
            typer.echo(str(path))


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401 - imported to learn whether it can be
    except ImportError:
        return False
    return True


def write_report(run_dir: Path, fmt: str = "png", out: Path | None = None) -> list[Path]:
    """Write the report; returns the files written. Raises ReportError on bad input."""
    if fmt not in FORMATS:
        raise ReportError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}", hint="use --format png, html or terminal")
    if fmt == "terminal":
        raise ReportError("--format terminal prints the report; it writes no file")
    if fmt == "png" and not has_matplotlib():
        raise ReportError(f"PNG plots need matplotlib, which is not installed: {INSTALL_HINT}",
                          hint="or use --format terminal (or html, without plots)")
    metrics = load_metrics(run_dir)
    figures = _figures(metrics) if has_matplotlib() else {}
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


def load_metrics(run_dir: Path) -> Metrics:
    """The run's metrics, or a ReportError saying what is missing."""
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
    return metrics


# Block characters from low to high: a loss trace that reads without colour or a font for plots.
SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 60


def sparkline(values: list[float], width: int = SPARK_WIDTH) -> str:
    """``values`` resampled to at most ``width`` points, each a block from low (▁) to high (█)."""
    values = [v for v in values if v is not None]
    if not values:
        return ""
    if len(values) > width:
        values = [values[i * len(values) // width] for i in range(width)]
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - low) / span * len(SPARK)))] for v in values)


def terminal_report(metrics: Metrics, run_dir: Path):
    """The summary table and, when steps were recorded, rank 0's loss trace (pure)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from zerorun.ui.render import sent_cell

    # Light boxes and per-collective seconds in a table of their own: both fit 80 columns.
    table = Table(title=f"zerorun report: {run_dir}", title_justify="left", header_style="bold", box=box.SIMPLE_HEAD,
                  padding=(0, 1), pad_edge=False, show_edge=False, collapse_padding=True)
    for name in ("rank", "host", "steps", "peak MiB", "comm wait", "samples/s", "sent/step", "last loss (own)"):
        table.add_column(name, justify="left" if name == "host" else "right", no_wrap=True)
    for rank, s in metrics.ranks.items():
        losses = [v for v in s.loss if v is not None]
        table.add_row(str(rank), Text(s.host), str(len(s.steps)), f"{s.mem_peak / MiB:.1f}", _wait_cell(s),
                      _rate_cell(s), sent_cell(sent_per_step(s)), f"{losses[-1]:.4f}" if losses else "-")
    ops = Table(header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False,
                collapse_padding=True)
    for name in ("collective", "calls", "seconds, all ranks", "per rank"):
        ops.add_column(name, justify="left" if name == "collective" else "right", no_wrap=True)
    for op in comm_ops(metrics):
        per_rank = [s.comm[op] for s in metrics.ranks.values() if op in s.comm]
        seconds = [c[2] for c in per_rank]
        ops.add_row(op, f"{sum(c[0] for c in per_rank)}×", f"{sum(seconds):.3f}", f"{min(seconds):.3f}-{max(seconds):.3f}")
    parts = [table, *((ops,) if ops.row_count else ()), Text(f"{len(metrics.ranks)} ranks, {metrics.duration_s:.1f} s of telemetry"
                         + (f", {metrics.skipped_lines} unreadable lines skipped" if metrics.skipped_lines else ""))]
    parts += [Text(line) for line in _run_lines(metrics)]
    parts.append(Text(LEGEND, style="dim"))
    first = next(iter(metrics.ranks.values()))
    losses = [v for v in first.loss if v is not None]
    if losses:
        parts.append(Text(f"loss (rank {next(iter(metrics.ranks))}, {losses[0]:.4f} -> {losses[-1]:.4f}): "
                          + sparkline(losses)))
    return Group(*parts)


LEGEND = ("comm wait: share of the run's step time spent blocked on collectives; <collective> s: "
          "issue-to-completion time (CPU) or transfer (GPU), summed (overlaps compute); samples/s: every step's samples over the summed "
          "step time; sent/step: bytes the rank sent per step (median over the steps), within its host|between "
          "hosts (the end-of-run summary's figures)")


def _wait_cell(s) -> str:
    share = comm_share(s)
    return "-" if share is None else f"{100 * share:.0f}%"


def _rate_cell(s) -> str:
    rate = throughput(s)
    return "-" if rate is None else f"{rate:.1f}"


def _sent_cells(s) -> tuple[str, str]:
    sent = sent_per_step(s)
    return ("-", "-") if sent is None else (f"{sent[0] / MiB:.2f}", f"{sent[1] / MiB:.2f}")


def _run_lines(metrics: Metrics) -> list[str]:
    """The job's throughput and the mean loss at the last step every rank reached, as the summary words them."""
    lines = []
    rates = [throughput(s) for s in metrics.ranks.values()]
    if rates and all(r is not None for r in rates):
        lines.append(f"job throughput: {sum(r for r in rates if r is not None):.1f} samples/s over the run")
    last = mean_last_loss(metrics)
    if last is not None:
        lines.append(f"last step {last[0]}: loss {last[1]:.4g} (mean of ranks)")
    return lines


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
    ax.set_ylim(bottom=0)  # from 0: a bar of 300 MiB growing to 310 must not look like a tripling
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
    ax.set(title="Communication time per collective type (issue to completion on CPU, transfer on GPU; overlaps compute)", ylabel="seconds")
    if ops:
        ax.legend(loc="best", fontsize="small")
    figures["comm"] = fig

    sent = {rank: sent_per_step(s) for rank, s in metrics.ranks.items()}
    if any(v is not None for v in sent.values()):
        fig = Figure(figsize=(8, 4), layout="constrained")
        ax = fig.add_subplot()
        ranks = list(sent)
        within = [(sent[r] or (0, 0))[0] / MiB for r in ranks]
        between = [(sent[r] or (0, 0))[1] / MiB for r in ranks]
        ax.bar(ranks, within, label="within its host")
        ax.bar(ranks, between, bottom=within, label="between hosts")
        ax.set_xticks(ranks, [f"rank {r}" for r in ranks])
        ax.set(title="Bytes sent per step (median over the steps)", ylabel="MiB")
        ax.legend(loc="best", fontsize="small")
        figures["link"] = fig

    if any(s.steps for s in metrics.ranks.values()):
        fig = Figure(figsize=(8, 5), layout="constrained")
        loss_ax, time_ax = fig.subplots(2, 1, sharex=True)
        for rank, s in metrics.ranks.items():
            points = [(st, lo) for st, lo in zip(s.steps, s.loss, strict=True) if lo is not None]
            if points:
                loss_ax.plot(*zip(*points, strict=True), label=f"rank {rank}")
            time_ax.plot(s.steps, s.step_time_s, label=f"rank {rank}")
        loss_ax.set(title="Loss and step time", ylabel="loss")
        time_ax.set(xlabel="step", ylabel="step time (s)")
        time_ax.legend(loc="best", fontsize="small")
        figures["steps"] = fig
    return figures


def _html(metrics: Metrics, figures: dict, run_dir: Path) -> str:
    ops = comm_ops(metrics)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ("rank", "host", "steps", "peak memory (MiB)", "comm wait",
                                                         *(f"{op} (s)" for op in ops), "samples/s",
                                                         "sent/step within host (MiB)", "sent/step between hosts (MiB)"))
    rows = []
    for rank, s in metrics.ranks.items():
        cells = [str(rank), html.escape(s.host), str(len(s.steps)), f"{s.mem_peak / MiB:.1f}", _wait_cell(s),
                 *(f"{s.comm[op][2]:.3f}" if op in s.comm else "-" for op in ops), _rate_cell(s), *_sent_cells(s)]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    images = []
    for name, figure in figures.items():
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=100)
        images.append(f'<h2>{name}</h2><img alt="{name}" src="data:image/png;base64,'
                      f'{base64.b64encode(buffer.getvalue()).decode()}">')
    note = f"<p>{metrics.skipped_lines} unreadable lines skipped.</p>" if metrics.skipped_lines else ""
    if not figures:
        note += f"<p>No plots: matplotlib is not installed ({html.escape(INSTALL_HINT)}).</p>"
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>zerorun report</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style></head><body>"
        f"<h1>zerorun report: {html.escape(str(run_dir))}</h1>"
        f"<p>{len(metrics.ranks)} ranks, {metrics.duration_s:.1f} s of telemetry.</p>{note}"
        + "".join(f"<p>{html.escape(line)}</p>" for line in _run_lines(metrics)) + f"<p>{html.escape(LEGEND)}</p>"
        f"<table><tr>{head}</tr>{''.join(rows)}</table>{''.join(images)}</body></html>"
    )


def _close(figures: dict) -> None:
    figures.clear()  # Figure objects (not pyplot) are freed with their last reference
