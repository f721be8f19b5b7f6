"""python -m zerorun.launch.agent   (started by the launcher over ssh; reads its job on stdin)

One agent per host spawns and supervises that host's workers. The local host runs the same
agent as a child process of the launcher (not over ssh), so local and remote workers are
started, read and ended by one code path, and a launcher killed outright still closes every
agent's stdin.

Protocol (JSON lines). stdin: first line is the node's job ``{"host", "cwd", "env",
"grace_s", "workers": [{"rank", "local_rank", "argv", "env"}]}``; afterwards ``stop`` ends
every worker. EOF on stdin (the ssh session is gone) also ends every worker, so a launcher
that dies cannot leave workers behind. stdout: events
    {"t": "started", "rank", "pid"}      a worker is running
    {"t": "out", "rank", "line"}         one line of its stdout/stderr
    {"t": "tel", "rank", "line"}         one raw telemetry line it wrote to ZERORUN_TELEMETRY_FD
    {"t": "exit", "rank", "rc"}          it ended (after its last output line)
    {"t": "done"}                        every worker has ended; the agent exits
Telemetry rides this same stdout, so no port is opened on any host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from zerorun.launch.processes import end_groups

# A telemetry line longer than this is dropped rather than buffered without bound.
MAX_TELEMETRY_LINE = 1 << 20

Emit = Callable[[dict], None]


class NodeAgent:
    """Starts one host's workers, streams their output/telemetry/exits to ``emit``, ends them."""

    def __init__(self, workers: list[dict], *, emit: Emit, cwd: str | None = None,
                 base_env: dict[str, str] | None = None, grace_s: float = 3.0):
        self.workers = workers
        self.emit = emit
        self.cwd = cwd
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.grace_s = grace_s
        self._procs: dict[int, subprocess.Popen] = {}
        self._waiters: list[threading.Thread] = []
        self._stop_lock = threading.Lock()
        self._stopped = False

    # -- starting -----------------------------------------------------------------------
    def start(self) -> None:
        for worker in self.workers:
            self._spawn(worker)

    def _spawn(self, worker: dict) -> None:
        rank = worker["rank"]
        read_fd, write_fd = os.pipe()
        env = {**self.base_env, **worker["env"], "ZERORUN_TELEMETRY_FD": str(write_fd)}
        try:
            proc = subprocess.Popen(
                worker["argv"],
                cwd=self.cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                # Own session => own process group: teardown signals the group, which also
                # reaches anything the worker forked, and a Ctrl-C typed at the launcher's
                # terminal does not hit workers before the launcher decides what to do.
                start_new_session=True,
            )
        except OSError as err:
            os.close(read_fd)
            os.close(write_fd)
            self.emit({"t": "out", "rank": rank, "line": f"zerorun: cannot start {worker['argv'][0]}: {err}"})
            self.emit({"t": "exit", "rank": rank, "rc": 127})
            return
        os.close(write_fd)  # only the worker holds the write end: EOF when it is gone
        with self._stop_lock:
            self._procs[rank] = proc
            stopped = self._stopped
        if stopped:  # a stop raced with the spawn: end this worker at once
            end_groups([proc.pid], 0.0)
        self.emit({"t": "started", "rank": rank, "pid": proc.pid})
        output = self._thread(self._pump_output, rank, proc)
        telemetry = self._thread(self._pump_telemetry, rank, read_fd)
        self._waiters.append(self._thread(self._await_exit, rank, proc, (output, telemetry)))

    def _thread(self, target, *args) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        return thread

    # -- reading ------------------------------------------------------------------------
    def _pump_output(self, rank: int, proc: subprocess.Popen) -> None:
        for raw in proc.stdout:
            self.emit({"t": "out", "rank": rank, "line": raw.decode("utf-8", "replace").rstrip("\r\n")})
        proc.stdout.close()

    def _pump_telemetry(self, rank: int, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb") as stream:
            while True:
                raw = stream.readline(MAX_TELEMETRY_LINE + 1)
                if not raw:
                    return
                if len(raw) > MAX_TELEMETRY_LINE:
                    # Skip the rest of an oversized line.
                    while raw and not raw.endswith(b"\n"):
                        raw = stream.readline(MAX_TELEMETRY_LINE)
                    continue
                self.emit({"t": "tel", "rank": rank, "line": raw.decode("utf-8", "replace").rstrip("\n")})

    def _await_exit(self, rank: int, proc: subprocess.Popen, readers: tuple[threading.Thread, ...]) -> None:
        rc = proc.wait()
        # The last output lines (a traceback) and the last telemetry (final step) must reach
        # the launcher before the exit event, but a grandchild holding a pipe open must not
        # delay the exit report: the wait for them is bounded.
        deadline = time.monotonic() + 1.0
        for reader in readers:
            reader.join(timeout=max(0.0, deadline - time.monotonic()))
        self.emit({"t": "exit", "rank": rank, "rc": rc})

    # -- ending -------------------------------------------------------------------------
    def stop(self) -> None:
        """End every worker group: TERM, ``grace_s``, KILL. Safe to call more than once."""
        with self._stop_lock:
            self._stopped = True
            pgids = [proc.pid for proc in self._procs.values()]
        end_groups(pgids, self.grace_s)

    def reap_leftovers(self) -> None:
        """KILL whatever is left in the worker groups (children a finished worker left behind)."""
        with self._stop_lock:
            pgids = [proc.pid for proc in self._procs.values()]
        end_groups(pgids, 0.0)

    def wait(self) -> None:
        """Until every worker has exited and been reported.

        Only the exit waiters are joined: a pipe reader can outlive its worker when a
        grandchild inherited the pipe, and reap_leftovers() is what ends that grandchild.
        """
        for thread in list(self._waiters):
            thread.join()


def write_job_files(files: dict[str, str]) -> None:
    """Write the run's files (config.json) where the workers expect them, unless identical.

    Skipping identical files matters on a shared filesystem: another host's workers may be
    reading the very same path.
    """
    for path, content in files.items():
        try:
            with open(path, encoding="utf-8") as existing:
                if existing.read() == content:
                    continue
        except OSError:
            pass
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.tmp{os.getpid()}"
        with open(temporary, "w", encoding="utf-8") as out:
            out.write(content)
        os.replace(temporary, path)


def _serve() -> int:
    """The remote side: read the job, run it, stream events, end on 'stop' or EOF."""
    out_lock = threading.Lock()
    broken = threading.Event()

    def emit(event: dict) -> None:
        data = (json.dumps(event) + "\n").encode()
        with out_lock:
            try:
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            except (BrokenPipeError, OSError):
                broken.set()

    first = sys.stdin.buffer.readline()
    if not first:
        return 2
    job = json.loads(first)
    write_job_files(job.get("files", {}))
    agent = NodeAgent(
        job["workers"],
        emit=emit,
        cwd=job.get("cwd"),
        base_env={**os.environ, **job.get("env", {})},
        grace_s=float(job.get("grace_s", 3.0)),
    )
    stop_requested = threading.Event()

    def request_stop(*_):
        # Called from a signal handler or the stdin watcher: hand the (blocking) teardown
        # to its own thread, once.
        if not stop_requested.is_set():
            stop_requested.set()
            threading.Thread(target=agent.stop, daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, request_stop)

    def watch_stdin():
        # Any line ("stop") or EOF (launcher or ssh session gone) ends the job on this host.
        sys.stdin.buffer.readline()
        request_stop()

    threading.Thread(target=watch_stdin, daemon=True).start()
    agent.start()
    agent.wait()
    if broken.is_set():
        agent.stop()
    agent.reap_leftovers()
    emit({"t": "done"})
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
