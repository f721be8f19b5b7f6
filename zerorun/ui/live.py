"""The launcher's view of a running job: the live Rich dashboard, or plain lines.

Contract with the launcher (zerorun/launch): it builds one ``JobView`` per job and calls
    view.start()
    view.on_output(host, rank, line)          # one line of a worker's stdout/stderr, no newline
    view.on_telemetry(host, raw_line)         # one raw telemetry line (bytes) from a worker
    view.on_worker_exit(host, rank, returncode)
    view.stop(failed: bool)                   # prints the end-of-run summary
All calls may come from several reader threads; the view serialises them.

This first version prints output lines with a rank prefix and ignores telemetry; the
telemetry issue replaces the body, keeping these signatures.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path


class JobView:
    def __init__(self, *, run_dir: Path, token: str, world_size: int, dashboard: bool, stream=None):
        self.run_dir = Path(run_dir)
        self.token = token
        self.world_size = world_size
        self.dashboard = dashboard
        self._stream = stream or sys.stdout
        self._lock = threading.Lock()

    def start(self) -> None:
        pass

    def on_output(self, host: str, rank: int, line: str) -> None:
        with self._lock:
            print(f"[rank{rank}] {line}", file=self._stream, flush=True)

    def on_telemetry(self, host: str, raw_line: bytes) -> None:
        pass

    def on_worker_exit(self, host: str, rank: int, returncode: int) -> None:
        pass

    def stop(self, failed: bool) -> None:
        pass
