"""Pure drawing: ``render(snapshot)`` -> a Rich renderable; no I/O, no clocks, no state.

Everything the dashboard shows is computed by zerorun.telemetry.collector and handed over as
a frozen ``Snapshot``; this module only lays it out, so it is tested by printing into
``Console(record=True)``. ``render_plain`` and ``render_summary`` draw the same snapshot as
one log line (not a terminal) and as the end-of-run table.
"""

from __future__ import annotations

from rich import box
from rich.console import Group, JustifyMethod, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from zerorun.telemetry.collector import RankView, Snapshot

# A rank silent for this long is drawn yellow, then red: samples arrive every interval_s (1 s).
STALE_AFTER_S = 5.0
STARTING = "starting"
# Each rank's own loss (its rows of the global batch); the header shows their mean.
OWN_LOSS = "own loss"
LOST_AFTER_S = 15.0
OUTPUT_PANEL_LINES = 8
MEMORY_BAR_WIDTH = 8
PROGRESS_BAR_WIDTH = 40
# Longer host names are cut here (a dashboard cell, not an identifier: the summary has them whole).
HOST_WIDTH = 12


def render(snapshot: Snapshot):
    parts: list[RenderableType] = [_header(snapshot)]
    if snapshot.total_steps:
        parts.append(_progress(snapshot, snapshot.total_steps))
    parts.append(_rank_table(snapshot))
    sent = sent_line(snapshot)
    if sent:
        parts.append(Text(sent))
    if snapshot.hang is not None:
        parts.append(Text(hang_message(snapshot), style="bold red"))
    dropped = dropped_message(snapshot)
    if dropped:
        parts.append(Text(dropped, style="yellow"))
    if snapshot.output:
        lines = Text("\n").join(
            Text.assemble((output_prefix(rank) + " ", "dim"), without_own_prefix(rank, line))
            for rank, line in snapshot.output[-OUTPUT_PANEL_LINES:]
        )
        parts.append(Panel(lines, title="output", title_align="left", border_style="dim"))
    return Group(*parts)


def output_prefix(rank: int) -> str:
    """``[rank3]``; a negative rank is a line from the launcher's agent, not from a worker."""
    return f"[rank{rank}]" if rank >= 0 else "[zerorun]"


def without_own_prefix(rank: int, line: str) -> str:
    """``line`` without torch.distributed's own ``[rankN]:`` for this rank (its uncaught-exception
    lines carry one), so the shown line is ``[rank1] Traceback``, not ``[rank1] [rank1]: Traceback``."""
    own = f"[rank{rank}]:"
    return line[len(own):].lstrip(" ") if rank >= 0 and line.startswith(own) else line


def prefixed_line(rank: int, line: str) -> str:
    """A worker's output line as the plain mode prints it: ``[rank3] text``."""
    return f"{output_prefix(rank)} {without_own_prefix(rank, line)}"


def _header(s: Snapshot) -> Text:
    text = Text.assemble(("zerorun", "bold cyan"), f"  {s.world_size} rank{'s' if s.world_size != 1 else ''}  {fmt_duration(s.elapsed_s)}")
    if s.step is not None:
        text.append(f"  step {s.step}" + (f"/{s.total_steps}" if s.total_steps else ""))
    if s.samples_per_s is not None:
        text.append(f"  {fmt_rate(s.samples_per_s)} samples/s", style="bold")
    if s.tokens_per_s is not None:
        text.append(f"  {fmt_rate(s.tokens_per_s)} tokens/s")
    if s.mean_loss is not None:
        text.append(f"  {mean_loss_label(s)}")
    return text


def mean_loss_label(s: Snapshot) -> str:
    """The header's loss says whose it is: the table's column holds each rank's own."""
    return f"loss {fmt_loss(s.mean_loss)} (mean of ranks)"


def eta_seconds(s: Snapshot) -> float | None:
    """Time to ``total_steps`` at the slowest rank's recent step time (every rank waits for it)."""
    times = [r.step_time_s for r in s.ranks if r.step_time_s]
    if not s.total_steps or s.step is None or not times:
        return None
    return max(0, s.total_steps - s.step) * max(times)


def _progress(s: Snapshot, total_steps: int) -> Text:
    done = min(s.step or 0, total_steps)
    text = Text.assemble(bar(done / total_steps, PROGRESS_BAR_WIDTH, "cyan"), f" {100 * done / total_steps:.0f}%")
    eta = eta_seconds(s)
    if eta is not None:
        text.append(f"  ETA {fmt_duration(eta)}")
    return text


def comm_cell(r: RankView) -> str:
    """The share of the recent steps' time spent waiting for collectives (Note [comm share] in
    recorder.py); ``-`` before the first step."""
    return "-" if r.comm_fraction is None else f"{100 * r.comm_fraction:.0f}%"


def shows_straggler(r: RankView, s: Snapshot) -> bool:
    """A straggler tag, unless a hang names someone else: while a collective hangs, the ranks that
    never entered it are the story, and the others' comm shares only say they are waiting."""
    if not r.straggler:
        return False
    return s.hang is None or r.rank in s.hang.missing


def _rank_table(s: Snapshot) -> Table:
    # A light box, short cells and compact numbers: the table must fit an 80-column terminal.
    # The box's own blank divider is the only space between columns: every column counts at 80.
    table = Table(box=box.SIMPLE_HEAD, header_style="bold", show_edge=False, pad_edge=False, padding=(0, 0))
    labels = sorted({r.mem_label for r in s.ranks if r.mem_used is not None})
    mixed = len(labels) > 1  # e.g. some ranks on GPU, some on CPU: label every cell instead
    memory = f"mem ({labels[0]})" if len(labels) == 1 else "mem"
    scale = _memory_scale(s)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("rank", "right"), ("host", "left"), ("step", "right"), (OWN_LOSS, "right"), (memory, "left"),
        ("peak", "right"), ("comm", "right"), ("bw", "right"), ("seen", "right"), ("", "left"))
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True, min_width=len(name))
    for r in s.ranks:
        table.add_row(
            str(r.rank),
            Text(host_cell(r)[:HOST_WIDTH]),  # Text, not str: a host name is never read as markup
            "-" if r.step is None else str(r.step),
            fmt_loss(r.loss),
            _memory_cell(r, with_label=mixed, scale=scale),
            fmt_short(r.mem_peak),
            comm_cell(r),
            "-" if r.bandwidth_bps is None else f"{fmt_short(r.bandwidth_bps)}/s",
            _heartbeat_cell(r),
            _status_cell(r, shows_straggler(r, s)),
        )
    return table


# Note [bytes per link] in telemetry/recorder.py: bytes a rank sends per step, within its host |
# between hosts. A line under the tables, not a column: the dashboard's table already fills 80
# columns, and the summary's wide table would no longer fit a terminal.
SENT_LABEL = "sent/step within|between hosts"
SENT_RANKS_LISTED = 8  # beyond this many ranks the line gives each class's range over the ranks


def sent_cell(sent: tuple[float, float] | None) -> str:
    """``96M|0B``: bytes per step within the host | between hosts; ``-`` before a step said."""
    return "-" if sent is None else f"{fmt_short(sent[0])}|{fmt_short(sent[1])}"


def sent_line(s: Snapshot, run: bool = False) -> str:
    """``sent/step within|between hosts: r0=96M|0B  r1=96M|48M`` (a wrap falls between ranks,
    never inside one): the recent steps', or with ``run`` the run's (the summary); '' before any
    rank said."""
    known: list[tuple[int, tuple[float, float]]] = []
    for r in s.ranks:
        sent = r.run_sent_per_step if run else r.sent_per_step
        if sent is not None:
            known.append((r.rank, sent))
    if not known:
        return ""
    if len(known) <= SENT_RANKS_LISTED:
        return f"{SENT_LABEL}: " + "  ".join(f"r{rank}={sent_cell(sent)}" for rank, sent in known)
    within = [sent[0] for _, sent in known]
    between = [sent[1] for _, sent in known]
    return (f"{SENT_LABEL}, {len(known)} ranks: {fmt_short(min(within))}-{fmt_short(max(within))}"
            f"|{fmt_short(min(between))}-{fmt_short(max(between))}")


def host_cell(r: RankView) -> str:
    return "-" if r.heartbeat_age_s is None and r.host == "?" else r.host


def _memory_scale(s: Snapshot) -> int | None:
    """What a bar without a device capacity is drawn against: the largest peak of any rank.

    A CPU rank's capacity is the whole host's memory, against which a training process is a
    sliver (an empty bar); against the job's largest peak the bars compare ranks and show how
    close each is to its high-water mark.
    """
    peaks = [r.mem_peak or r.mem_used for r in s.ranks if r.mem_used is not None and r.mem_label != "gpu"]
    peaks = [p for p in peaks if p]
    return max(peaks) if peaks else None


def _memory_cell(r: RankView, with_label: bool, scale: int | None = None) -> Text:
    """A bar and the numbers: against the device's capacity on a GPU, else against ``scale``."""
    if r.mem_used is None:
        return Text("-")
    label = f"{r.mem_label} {fmt_short(r.mem_used)}" if with_label else fmt_short(r.mem_used)
    if r.mem_label == "gpu" and r.mem_capacity:
        fraction = min(1.0, r.mem_used / r.mem_capacity)
        style = "red" if fraction > 0.9 else "yellow" if fraction > 0.75 else "green"
        return Text.assemble(bar(fraction, MEMORY_BAR_WIDTH, style), f" {label}/{fmt_short(r.mem_capacity)}")
    if scale:
        return Text.assemble(bar(r.mem_used / scale, MEMORY_BAR_WIDTH, "cyan"), f" {label}")
    return Text(label)


def bar(fraction: float, width: int, style: str = "green") -> Text:
    """A fixed-width bar of block characters, readable without colour (logs, recorded consoles)."""
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return Text.assemble(("█" * filled, style), ("░" * (width - filled), "dim"))


def _heartbeat_cell(r: RankView) -> Text:
    if r.heartbeat_age_s is None:
        # Not heard from yet: starting (imports, process group) until it has exited unheard.
        return Text("never", style="red") if r.exit_code is not None else Text(STARTING, style="dim")
    style = "red" if r.heartbeat_age_s > LOST_AFTER_S else "yellow" if r.heartbeat_age_s > STALE_AFTER_S else "green"
    return Text(f"{r.heartbeat_age_s:.0f}s", style=style)


def _status_cell(r: RankView, straggler: bool) -> Text:
    # Short words: the collective's name is in the hang line once the wait becomes a hang.
    text = Text()
    if r.exit_code is not None and r.exit_code < 0:
        # Ended by a signal: the launcher's own stop (Ctrl-C, a failure elsewhere) or a kill.
        text.append(signal_name(-r.exit_code), style="yellow")
    elif r.exit_code is not None:
        text.append(f"exit {r.exit_code}", style="green" if r.exit_code == 0 else "bold red")
    elif r.blocked is not None and r.blocked.waited_s >= 1:
        text.append(f"in #{r.blocked.seq} {r.blocked.waited_s:.0f}s", style="yellow")
    if straggler:
        text.append(" ◀ slow" if text else "◀ slow", style="bold magenta")
    return text


def signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def hang_message(s: Snapshot) -> str:
    h = s.hang
    if h is None:
        return ""
    waiting = f"rank{'s' if len(h.waiting) > 1 else ''} {_ranks(h.waiting)} waiting {h.waited_s:.0f}s"
    if h.missing:
        who = f"rank{'s' if len(h.missing) > 1 else ''} {_ranks(h.missing)}"
        return f"HANG: {who} {'have' if len(h.missing) > 1 else 'has'} not entered collective #{h.seq} ({h.op}); {waiting}"
    return f"HANG: collective #{h.seq} ({h.op}) entered by every rank but not finished; {waiting}"


def dropped_message(s: Snapshot) -> str:
    counts = [(reason, n) for reason, n in s.dropped if n]
    if not counts:
        return ""
    total = sum(n for _, n in counts)
    return f"dropped {total} telemetry line{'s' if total > 1 else ''} (" + ", ".join(f"{n} {r}" for r, n in counts) + ")"


def render_plain(s: Snapshot) -> str:
    """One log line for logs and pipes: the same facts as the dashboard, no escape codes."""
    head = f"[zerorun] {fmt_duration(s.elapsed_s)}"
    if s.step is not None:
        head += f" step {s.step}" + (f"/{s.total_steps}" if s.total_steps else "")
    if s.samples_per_s is not None:
        head += f" {fmt_rate(s.samples_per_s)} samples/s"
    eta = eta_seconds(s)
    if eta is not None:
        head += f" ETA {fmt_duration(eta)}"
    if s.mean_loss is not None:
        head += f" {mean_loss_label(s)}"
    parts = [head]
    for r in s.ranks:
        if r.heartbeat_age_s is None and r.exit_code is None:
            parts.append(f"r{r.rank} {STARTING}")
            continue
        item = f"r{r.rank} mem {fmt_bytes(r.mem_used)}"
        if r.loss is not None:
            item += f" {OWN_LOSS} {fmt_loss(r.loss)}"
        if r.comm_fraction is not None:
            item += f" comm {100 * r.comm_fraction:.0f}%"
        if r.sent_per_step is not None:
            item += f" sent/step {sent_cell(r.sent_per_step)}"
        if shows_straggler(r, s):
            item += " STRAGGLER"
        parts.append(item)
    line = " | ".join(parts)
    if s.hang is not None:
        line += " | " + hang_message(s)
    return line


class FirstThatFits:
    """Draws the first of ``choices`` whose natural width fits the console, else the last one.

    Pure like the rest of this module: the choice depends only on the width Rich offers.
    """

    def __init__(self, *choices):
        self.choices = choices

    def __rich_console__(self, console, options):
        from rich.measure import Measurement

        # Measured with room to spare: a table measured at the console's width reports that width.
        roomy = options.update_width(10_000)
        for choice in self.choices[:-1]:
            if Measurement.get(console, roomy, choice).maximum <= options.max_width:
                yield choice
                return
        yield self.choices[-1]


def render_summary(s: Snapshot, failed: bool = False, interrupted: bool = False, ended: str | None = None):
    """End-of-run table: per-rank peak memory, time per collective type, throughput.

    One column per collective type when that fits the terminal; otherwise (80 columns, three
    collective types) a rank table and a collective table, so no cell is cut. ``ended``: how the
    job ended where the scheduler knows better than the workers' exits ("cancelled", "preempted":
    Slurm ended the steps, the closing line says the same)."""
    # A failure outranks the interrupt it may have caused; workers the launcher stopped are no failure.
    if ended is None:
        ended = "failed" if failed else "interrupted" if interrupted else "finished"
    title = f"zerorun summary ({ended} after {fmt_duration(s.elapsed_s)})"
    parts: list[RenderableType] = [FirstThatFits(_summary_wide(s, title), Group(*_summary_narrow(s, title)))]
    sent = sent_line(s, run=True)
    if sent:
        parts.append(Text(sent))
    if s.run_samples_per_s is not None:
        parts.append(Text(f"job throughput: {fmt_rate(s.run_samples_per_s)} samples/s over the run"))
    if s.mean_loss is not None:
        parts.append(Text(f"last step {s.step}: {mean_loss_label(s)}"))
    if any(r.run_samples_per_s is not None or r.run_comm_fraction is not None or r.comm or r.run_sent_per_step
           for r in s.ranks):
        parts.append(Text(SUMMARY_LEGEND, style="dim"))  # what the figures mean, when there are any
    if s.hang is not None:
        parts.append(Text(hang_message(s), style="bold red"))
    dropped = dropped_message(s)
    if dropped:
        parts.append(Text(dropped, style="yellow"))
    return Group(*parts)


SUMMARY_LEGEND = ("comm wait: share of the run's step time spent blocked on collectives; "
                  "<collective> s: issue-to-completion time (CPU) or transfer (GPU), summed (overlaps compute); "
                  "samples/s: every step's samples over the summed step time; "
                  "sent/step: bytes a rank sent per step (median over the steps), within its host|between hosts")


def _run_rate(r: RankView) -> str:
    return "-" if r.run_samples_per_s is None else fmt_rate(r.run_samples_per_s)


def _run_wait(r: RankView) -> str:
    return "-" if r.run_comm_fraction is None else f"{100 * r.run_comm_fraction:.0f}%"


def _summary_narrow(s: Snapshot, title: str) -> list[Table]:
    with_state = any(r.breakdown for r in s.ranks)
    ranks = Table(title=title, header_style="bold", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("rank", "host", "steps", "peak", *(("model state",) if with_state else ()), "comm wait", "samples/s"):
        ranks.add_column(name, justify="left" if name == "host" else "right", no_wrap=True)
    for r in s.ranks:
        ranks.add_row(
            str(r.rank), Text(host_cell(r)[:HOST_WIDTH]), "-" if r.step is None else str(r.step),
            f"{r.mem_label} {fmt_short(r.mem_peak)}" if r.mem_peak is not None else "-",
            *((fmt_short(model_state_bytes(r)),) if with_state else ()),
            _run_wait(r),
            _run_rate(r),
        )
    tables = [ranks]
    offloaded = [(r.rank, offloaded_label(r)) for r in s.ranks if offloaded_label(r)]
    if offloaded:  # a line of its own: as a column it would not fit 80 columns
        ranks.caption = "offloaded: " + ", ".join(f"rank {rank} {label}" for rank, label in offloaded)
        ranks.caption_justify = "left"
    if s.comm_totals:
        ops = Table(header_style="bold", box=box.SIMPLE_HEAD)
        for name in ("collective", "calls", "data", "seconds, all ranks", "per rank"):
            ops.add_column(name, justify="left" if name == "collective" else "right", no_wrap=True)
        for total in s.comm_totals:
            per_rank = [c.seconds for r in s.ranks for c in r.comm if c.op == total.op]
            spread = f"{min(per_rank):.3f}-{max(per_rank):.3f}" if per_rank else "-"
            ops.add_row(total.op, f"{total.count}×", fmt_short(total.nbytes), f"{total.seconds:.3f}", spread)
        tables.append(ops)
    return tables


def _summary_wide(s: Snapshot, title: str) -> Table:
    ops = [c.op for c in s.comm_totals]
    table = Table(title=title, header_style="bold", title_justify="left")
    with_state = any(r.breakdown for r in s.ranks)
    state_column = ("model state",) if with_state else ()
    with_offload = any(offloaded_label(r) for r in s.ranks)
    offload_column = ("offloaded",) if with_offload else ()
    for name in ("rank", "host", "steps", "peak memory", *state_column, *offload_column,
                 "comm wait", *(f"{op} s" for op in ops), "samples/s"):
        table.add_column(name, justify="left" if name == "host" else "right", no_wrap=True)
    for r in s.ranks:
        seconds = {c.op: c for c in r.comm}
        table.add_row(
            str(r.rank),
            Text(host_cell(r)),  # Text, not str: a host name is never read as markup
            "-" if r.step is None else str(r.step),
            f"{r.mem_label} {fmt_bytes(r.mem_peak)}" if r.mem_peak is not None else "-",
            *((fmt_bytes(model_state_bytes(r)),) if with_state else ()),
            *((offloaded_label(r) or "-",) if with_offload else ()),
            _run_wait(r),
            *(_comm_cell(seconds.get(op)) for op in ops),
            _run_rate(r),
        )
    return table


OFFLOADED = {"offloaded_host": "host", "offloaded_nvme": "nvme"}


def model_state_bytes(r: RankView):
    """The engine's own total when it sends one, else the sum of its parts; None without a breakdown.
    Offloaded bytes (host memory, NVMe files) are not the device's and are shown apart."""
    parts = dict(r.breakdown)
    if not parts:
        return None
    if parts.get("total") is not None:
        return parts["total"]
    return sum(v for k, v in parts.items() if v is not None and k not in OFFLOADED)


def offloaded_label(r: RankView) -> str:
    """``host 1.2G nvme 48M``: what the engine keeps off the device (offload.py); '' for none."""
    parts = dict(r.breakdown)
    return " ".join(f"{label} {fmt_short(parts[key])}" for key, label in OFFLOADED.items() if parts.get(key))


def _comm_cell(c) -> str:
    return "-" if c is None else f"{c.seconds:.3f} ({c.count}×)"


def _ranks(ranks) -> str:
    return ",".join(str(r) for r in ranks)


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - loop always returns


def fmt_short(n) -> str:
    """Bytes in at most 5 characters for dashboard cells (binary units): ``512B``, ``1.5K``,
    ``900M``, ``6.0G``; one decimal only below 100."""
    if n is None:
        return "-"
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 999.5 or unit == "T":  # below 1000, not 1024: "1023K" would not fit
            return f"{n:.0f}{unit}" if unit == "B" or abs(n) >= 99.95 else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.0f}T"  # pragma: no cover - loop always returns


def fmt_loss(x) -> str:
    """Four significant digits: 2.310, 0.01234, 1.2e+04."""
    return "-" if x is None else f"{x:.4g}"


def fmt_rate(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:.1f}"


def fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
