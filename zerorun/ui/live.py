"""The launcher's view of a running job: the live Rich dashboard, or plain lines.

Contract with the launcher (zerorun/launch): it builds one ``JobView`` per job and calls
    view.start()
    view.on_output(host, rank, line)          # one line of a worker's stdout/stderr, no newline
    view.on_telemetry(host, raw_line)         # one raw telemetry line (bytes) from a worker
    view.on_worker_exit(host, rank, returncode)
    view.stop(failed: bool, interrupted=False) # prints the end-of-run summary
All calls may come from several reader threads; the collector and a lock serialise them.

Two modes, chosen once in ``start``:
* dashboard=True and the stream is a terminal: a ``rich.live.Live`` redraws
  ``render(collector.snapshot())`` twice a second; worker output goes to its panel.
* otherwise: output lines are printed with a rank prefix as they come, a status line every
  ``status_interval_s``, and a hang line as soon as a hang is detected.
No judgement lives here: it is all in zerorun.telemetry.collector and zerorun.ui.render.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.live import Live

from zerorun.telemetry.collector import Collector
from zerorun.telemetry.settings import env_number, monitor_section, telemetry_config
from zerorun.ui import render as draw

if TYPE_CHECKING:
    from zerorun.telemetry.monitor import Monitor

# How often the plain mode checks for a new hang; status lines come every status_interval_s.
_TICK_S = 0.5


class JobView:
    # Note [one writer] in telemetry/monitor.py: the view that sees the whole job writes the
    # monitor series; a node that forwards its ranks to node 0 (launch/job_view.py) does not.
    writes_monitor = True

    def __init__(self, *, run_dir: Path, token: str, world_size: int, dashboard: bool, stream=None,
                 total_steps: int | None = None, hang_after_s: float | None = None,
                 status_interval_s: float = 10.0):
        """``total_steps`` / ``hang_after_s``: argument > ZERORUN_TOTAL_STEPS / ZERORUN_HANG_AFTER_S >
        the ``telemetry`` section of RUN_DIR/config.json (written by the launcher) > defaults."""
        self.run_dir = Path(run_dir)
        self.token = token
        self.world_size = world_size
        self.dashboard = dashboard
        self._stream = stream or sys.stdout
        self._ended_as: str | None = None
        self._lock = threading.Lock()
        config = telemetry_config(self.run_dir / "config.json")
        if total_steps is None:
            total_steps = env_number("ZERORUN_TOTAL_STEPS", int, config.total_steps)
        if hang_after_s is None:
            hang_after_s = env_number("ZERORUN_HANG_AFTER_S", float, config.hang_after_s)
        self.collector = Collector(token=token, world_size=world_size, run_dir=self.run_dir,
                                   total_steps=total_steps, hang_after_s=hang_after_s, listener=self._on_record)
        self.monitor: Monitor | None = None
        self._monitor_lock = threading.Lock()
        section = monitor_section(self.run_dir / "config.json")
        if section is not None:
            self._open_monitor(section, base=Path.cwd())
        self.status_interval_s = status_interval_s
        self._console: Console | None = None
        self._live: Live | None = None
        self._ticker: threading.Thread | None = None
        self._stopped = threading.Event()
        self._reported_hangs: set[int] = set()
        self._stop_done = False

    @property
    def live_mode(self) -> bool:
        return self._live is not None

    def start(self) -> None:
        is_tty = bool(getattr(self._stream, "isatty", lambda: False)())
        if self.dashboard and is_tty:
            self._console = Console(file=self._stream)
            self._live = Live(console=self._console, refresh_per_second=2, redirect_stdout=False,
                              redirect_stderr=False, get_renderable=lambda: draw.render(self.collector.snapshot()))
            self._live.start()
        else:
            # Not a terminal: no colours, and a width that keeps table rows on one line in log files.
            self._console = Console(file=self._stream, width=140, no_color=True, highlight=False)
            self._ticker = threading.Thread(target=self._plain_loop, name="zerorun-status", daemon=True)
            self._ticker.start()

    def on_output(self, host: str, rank: int, line: str) -> None:
        self.collector.add_output(rank, line)
        if self._live is None:
            self._print(draw.prefixed_line(rank, line))

    def on_telemetry(self, host: str, raw_line: bytes) -> None:
        self.collector.ingest(host, raw_line)

    def _on_record(self, record: dict) -> None:
        """Every accepted record: to the monitor writer, or, from rank 0's engine, the monitor
        section of a config the script gave ``initialize`` itself (its paths already absolute)."""
        with self._monitor_lock:
            if self.monitor is not None:
                self.monitor.add(record)
                return
        if record.get("kind") == "monitor" and record.get("rank") == 0:
            self._open_monitor(record["monitor"], base=Path.cwd())

    def _open_monitor(self, section: dict, *, base: Path) -> None:
        from zerorun.telemetry.monitor import Monitor, open_sinks

        if not self.writes_monitor:
            return
        sinks, problems = open_sinks(section, base=base, run_dir=self.run_dir)
        for problem in problems:
            self.on_output("launcher", -1, f"zerorun: warning: {problem}")
        with self._monitor_lock:
            if self.monitor is None and sinks:
                self.monitor = Monitor(self.world_size, sinks,
                                       warn=lambda text: self.on_output("launcher", -1, f"zerorun: warning: {text}"))

    def on_worker_exit(self, host: str, rank: int, returncode: int) -> None:
        self.collector.worker_exited(rank, returncode)

    def stop(self, failed: bool, *, interrupted: bool = False) -> None:
        """``interrupted``: the launcher was stopped (Ctrl-C, a signal); the summary says so, not "failed"."""
        with self._lock:
            if self._stop_done:
                return
            self._stop_done = True
        self._stopped.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2)
        snapshot = self.collector.snapshot()
        if self._live is not None:
            self._live.update(draw.render(snapshot), refresh=True)
            self._live.stop()
        if self._console is None:  # stop() without start(): still report
            self._console = Console(file=self._stream, width=140, no_color=True, highlight=False)
        with self._lock:
            if self._live is None and snapshot.accepted and self.shows_status():
                # The plain mode's last status line: the figures at the end, as the summary has them.
                print(draw.render_plain(snapshot), file=self._stream, flush=True)
            words = self.closing_words(snapshot, failed=failed, interrupted=interrupted)
            if words is not None:
                self._console.print(words)
        self.collector.close()
        with self._monitor_lock:
            if self.monitor is not None:
                self.monitor.close()

    # Two hooks for a node whose ranks are shown by another launcher (launch/job_view.py).
    def shows_status(self) -> bool:
        """Whether the plain mode prints status lines (the job's figures) besides worker lines."""
        return True

    def closing_words(self, snapshot, *, failed: bool, interrupted: bool):
        """What ``stop`` prints last: the end-of-run summary (None: nothing)."""
        return draw.render_summary(snapshot, failed=failed, interrupted=interrupted, ended=self._ended_as)

    def name_ending(self, word: str) -> None:
        """How the job ended, in the summary's header, where Slurm ended it (the supervisor asks
        Slurm before ``stop``): "cancelled", not "failed", when scancel killed the workers."""
        self._ended_as = word

    def _plain_loop(self) -> None:
        ticks_per_status = max(1, round(self.status_interval_s / _TICK_S))
        tick = 0
        while not self._stopped.wait(_TICK_S):
            tick += 1
            snapshot = self.collector.snapshot(output_lines=0)
            hang = snapshot.hang
            if hang is not None and hang.seq not in self._reported_hangs:
                self._reported_hangs.add(hang.seq)
                self._print("[zerorun] " + draw.hang_message(snapshot))
            if tick % ticks_per_status == 0 and snapshot.accepted and self.shows_status():
                self._print(draw.render_plain(snapshot))

    def _print(self, text: str) -> None:
        with self._lock:
            print(text, file=self._stream, flush=True)
