"""One host's channel to its node agent, and where the channels put what they read.

``AgentChannel`` starts ``python -m zerorun.launch.agent`` on its host (a child process here,
over ssh, or as a Slurm step), sends it the job, reads its events on a thread of its own and
passes on stop, dump and checkpoint requests; ``OutputSink`` takes each rank's output from that
thread straight to the rank's log file, tail and the view (Note [bounded output] in agent.py).
Control events go to the supervisor's queue (supervisor.py), which makes every decision.
"""

from __future__ import annotations

import collections
import json
import queue
import subprocess
import threading
import time
from typing import IO

from zerorun.launch.commands import node_agent_command, on_host
from zerorun.launch.plan import LaunchPlan, NodeSpec
from zerorun.launch.processes import sweep_run
from zerorun.telemetry.sanitize import printable

# A line is kept (tail) and shown (terminal) up to this many characters; the log has all of it.
SHOWN_LINE_CHARS = 2000
# The agent's events are JSON lines of at most ~6x MAX_OUTPUT_LINE (escapes); this bounds a
# line that is not from the agent (a login banner) as well.
MAX_EVENT_LINE = 1 << 20


# --- output ---------------------------------------------------------------------------------


class OutputSink:
    """Where the channels' reader threads put worker output and telemetry, as it arrives.

    Each rank is read by exactly one thread (its host's channel), so its log file and tail need
    no lock. The log gets every byte; the tail and the view get each line cut to
    SHOWN_LINE_CHARS with control characters removed (sanitize.py), once per line however
    many pieces the agent sent it in.
    """

    def __init__(self, view, logs: dict, tails: dict[int, collections.deque]):
        self.view = view
        self.logs = logs
        self.tails = tails
        self.last_output = time.monotonic()
        self._continuing: set[int | None] = set()  # None: the launcher's own notes
        self._collector = getattr(view, "collector", None)
        self._closed = False

    def output(self, host: str, rank: int | None, line: str, more: bool = False) -> None:
        if rank is not None:  # a worker's line is progress; the launcher's own notes are not
            self.last_output = time.monotonic()
        log = self.logs.get(rank)
        if log is not None and not self._closed:
            try:
                log.write(line if more else line + "\n")
            except (OSError, ValueError):
                pass
        first_piece = rank not in self._continuing
        if more:
            self._continuing.add(rank)
        else:
            self._continuing.discard(rank)
        if not first_piece:
            return
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:  # bytes that were not UTF-8 (see the agent): shown replaced
            line = line.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        shown = printable(line, SHOWN_LINE_CHARS)
        if more and not shown.endswith("…"):
            shown += "…"
        if rank in self.tails:
            self.tails[rank].append(shown)
        try:
            self.view.on_output(host, rank if rank is not None else -1, shown)
        except (BrokenPipeError, OSError):
            pass  # the terminal (a pipe to head, say) is gone; the logs still get everything

    def telemetry(self, host: str, line: str) -> None:
        self.view.on_telemetry(host, line.encode("utf-8", "surrogateescape"))

    def telemetry_dropped(self, reason: str) -> None:
        count = getattr(self._collector, "count_dropped", None)
        if count is not None:
            count(reason)

    def close(self) -> None:
        self._closed = True
        for log in self.logs.values():
            log.close()


# --- channels -----------------------------------------------------------------------------


def _job_line(node: NodeSpec, plan: LaunchPlan, grace_s: float, files: dict[str, str] | None = None) -> dict:
    return {
        "host": node.host,
        "files": files or {},
        "cwd": plan.cwd,
        "env": plan.forwarded_env,
        "grace_s": grace_s,
        "workers": [{"rank": w.rank, "local_rank": w.local_rank, "argv": w.argv, "env": w.env} for w in node.workers],
    }


class AgentChannel:
    """One host's agent process: ``python -m zerorun.launch.agent``, here, over ssh or as a Slurm step.

    The local host gets an agent process too, not an in-process one: if the launcher is
    killed outright (SIGKILL, OOM killer), the agent sees EOF on its stdin and ends its
    workers, so no rank outlives the launcher on any host.
    """

    def __init__(self, node: NodeSpec, plan: LaunchPlan, events: queue.Queue, grace_s: float,
                 ssh_port: int | None, ssh_options: list[str], files: dict[str, str] | None = None):
        self.host = node.host
        self.local = node.local
        self.reach = node.reach
        self.events = events
        self.grace_s = grace_s
        self.sink: OutputSink | None = None
        self.ssh_port, self.ssh_options = ssh_port, ssh_options
        # The run's files (config.json) travel with the job: hosts need not share a filesystem.
        self.job = _job_line(node, plan, grace_s, files)
        self.cwd = plan.cwd if node.local else None
        self.argv = node_agent_command(node.reach, node.host, plan.cwd, plan.python, plan.forwarded_env,
                                       ssh_port=ssh_port, ssh_options=ssh_options)
        self.proc: subprocess.Popen[bytes] | None = None
        self._stdin: IO[bytes] | None = None
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self.done = False  # the agent said "done": it ended and reaped every worker itself
        self.killed = False  # finish() had to kill it: its workers' fate is unknown
        self._stdin_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self, sink: OutputSink) -> None:
        self.sink = sink
        self.proc = proc = subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C at the terminal must not hit it before we decide
        )
        # All three were asked for as pipes, so Popen made them; checked once, here (finish() ends proc).
        if proc.stdin is None or proc.stdout is None or proc.stderr is None:
            raise RuntimeError(f"the agent process for {self.host} started without its pipes")
        self._stdin = proc.stdin
        self._send(json.dumps(self.job))
        self._stderr_reader = threading.Thread(target=self._pump_stderr, args=(proc.stderr,), daemon=True)
        self._threads = [threading.Thread(target=self._pump_events, args=(proc, proc.stdout, sink), daemon=True),
                         self._stderr_reader]
        for thread in self._threads:
            thread.start()

    def _send(self, line: str) -> None:
        stdin = self._stdin
        if stdin is None:
            raise RuntimeError(f"the agent channel to {self.host} is not started")
        with self._stdin_lock:
            try:
                stdin.write((line + "\n").encode())
                stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass

    def _pump_events(self, proc: subprocess.Popen[bytes], stream: IO[bytes], sink: OutputSink) -> None:
        while True:
            raw = stream.readline(MAX_EVENT_LINE)
            if not raw:
                break
            if not raw.endswith(b"\n"):  # not an agent event: skip the rest of it
                while raw and not raw.endswith(b"\n"):
                    raw = stream.readline(MAX_EVENT_LINE)
                continue
            try:
                event = json.loads(raw)
                if not isinstance(event, dict):
                    raise ValueError
            except ValueError:
                # Not from the agent (a login banner, a shell message): keep it visible.
                event = {"t": "out", "rank": None, "line": raw.decode("utf-8", "replace").rstrip("\n")}
            self._deliver(event, sink)
        self._stderr_reader.join(timeout=1.0)  # ssh's own last words explain a lost session
        rc = proc.wait()
        self.events.put((self.host, {"t": "gone", "rc": rc, "stderr": list(self.stderr_tail)}))

    def _deliver(self, event: dict, sink: OutputSink) -> None:
        kind, rank = event.get("t"), event.get("rank")
        if kind == "out":
            sink.output(self.host, rank, str(event.get("line", "")), bool(event.get("more")))
        elif kind == "tel":
            sink.telemetry(self.host, str(event.get("line", "")))
        elif kind == "tel_dropped":
            sink.telemetry_dropped(str(event.get("reason", "oversized")))
        else:
            if kind == "done":
                self.done = True
            self.events.put((self.host, event))

    def _pump_stderr(self, stream: IO[bytes]) -> None:
        while True:
            raw = stream.readline(4096)
            if not raw:
                return
            self.stderr_tail.append(printable(raw.decode("utf-8", "replace"), 500))

    def stop(self) -> None:
        self._send("stop")

    def dump_stacks(self) -> None:
        self._send("dump")

    def checkpoint(self) -> None:
        self._send("checkpoint")

    def finish(self) -> None:
        """Wait for the agent to end its workers; if it does not, close the session (EOF ends them)."""
        if self.proc is None:
            return
        self.stop()
        try:
            self.proc.wait(timeout=self.grace_s + 5.0)
        except subprocess.TimeoutExpired:
            self.killed = True
            if self.reach == "srun":
                # srun passes SIGTERM on to the step (the agent ends its workers); a killed srun
                # would leave the step to Slurm's own timeouts.
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=self.grace_s + 5.0)
                except subprocess.TimeoutExpired:
                    pass
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        for thread in self._threads:
            thread.join(timeout=2.0)

    def sweep(self, token: str, wait_s: float) -> str | None:
        """Make sure no process of the run is left on this host; None when confirmed, else why not."""
        if self.local:
            result = sweep_run(token, wait_s)
        else:
            remote = self._sweep_remote(token, wait_s)
            if isinstance(remote, str):
                return remote
            result = remote
        if result["left"]:
            return f"{result['left']} process(es) of the run could not be ended"
        return None

    def _sweep_remote(self, token: str, wait_s: float) -> dict | str:
        import inspect

        source = inspect.getsource(sweep_run) + (
            "\nimport json, sys\nprint(json.dumps(sweep_run(sys.stdin.readline().strip(), float(sys.argv[1]))))\n"
        )
        python = self.job["workers"][0]["argv"][0] if self.job["workers"] else "python3"
        command = on_host(self.reach, self.host, "/", [python, "-c", source, str(wait_s)],
                          ssh_port=self.ssh_port, ssh_options=self.ssh_options)
        try:
            done = subprocess.run(command, input=(token + "\n").encode(), capture_output=True, timeout=wait_s + 30)
            return json.loads(done.stdout.decode().strip().splitlines()[-1])
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
            return f"unreachable over {self.reach} to check that its workers ended"
