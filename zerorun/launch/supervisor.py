"""Runs a LaunchPlan: one node agent per host, events to the JobView and per-rank logs.

Every host is a *channel* to one agent process that delivers the agent protocol's events
(see agent.py) into one queue: the local host's agent is a child process, remote hosts' run
over ssh, so both are started, read and stopped by the same code. The
supervisor is the only consumer, so ordering decisions ("which failure came first") are made
in one place. The first worker to exit non-zero (or a host whose ssh session drops) is the
root cause; every host is then told to stop (TERM, grace, KILL by process group).
"""

from __future__ import annotations

import collections
import json
import queue
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from zerorun.launch.commands import agent_argv, remote_shell_command, ssh_argv
from zerorun.launch.plan import LaunchPlan, NodeSpec
from zerorun.launch.processes import describe_exit

TAIL_LINES = 200
SHOWN_LOG_LINES = 10


@dataclass
class Failure:
    host: str
    rank: int | None
    reason: str
    returncode: int | None = None
    log_tail: list[str] = field(default_factory=list)

    @property
    def traceback(self) -> list[str]:
        return extract_traceback(self.log_tail)


@dataclass
class JobResult:
    failure: Failure | None
    interrupted: bool
    exit_codes: dict[int, int]
    run_dir: str

    @property
    def ok(self) -> bool:
        return self.failure is None and not self.interrupted


# torch.distributed prefixes a worker's uncaught-exception lines with "[rankN]: ".
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


def extract_traceback(lines: list[str]) -> list[str]:
    """The last Python traceback in ``lines`` (through its final exception line), or []."""
    lines = [_RANK_PREFIX.sub("", line) for line in lines]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return []
    block = lines[starts[-1]:]
    # The traceback ends at the first unindented line after its header (the exception).
    for offset, line in enumerate(block[1:], start=1):
        if line and not line.startswith((" ", "\t")):
            return block[: offset + 1]
    return block


def format_failure(failure: Failure) -> str:
    """The root-cause panel text: host, rank, exit, last log lines, traceback."""
    who = f"rank {failure.rank} on host {failure.host}" if failure.rank is not None else f"host {failure.host}"
    lines = [f"first failure: {who}: {failure.reason}"]
    traceback = failure.traceback
    # Lines already shown in the traceback section are not repeated above it.
    shown = [
        line for line in failure.log_tail[-SHOWN_LOG_LINES:] if _RANK_PREFIX.sub("", line) not in traceback
    ]
    if shown:
        lines.append("last lines of its log:")
        lines += [f"  | {line}" for line in shown]
    if traceback:
        lines.append("traceback:")
        lines += [f"  | {line}" for line in traceback]
    return "\n".join(lines)


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
    """One host's agent process: ``python -m zerorun.launch.agent``, here or over ssh.

    The local host gets an agent process too, not an in-process one: if the launcher is
    killed outright (SIGKILL, OOM killer), the agent sees EOF on its stdin and ends its
    workers, so no rank outlives the launcher on any host.
    """

    def __init__(self, node: NodeSpec, plan: LaunchPlan, events: queue.Queue, grace_s: float,
                 ssh_port: int | None, ssh_options: list[str], files: dict[str, str] | None = None):
        self.host = node.host
        self.events = events
        self.grace_s = grace_s
        # The run's files (config.json) travel with the job: hosts need not share a filesystem.
        self.job = _job_line(node, plan, grace_s, files)
        if node.local:
            self.argv, self.cwd = agent_argv(plan.python), plan.cwd
        else:
            self.cwd = None
            self.argv = ssh_argv(
                node.host,
                remote_shell_command(plan.cwd, agent_argv(plan.python)),
                ssh_port=ssh_port,
                extra_options=ssh_options,
            )
        self.proc: subprocess.Popen | None = None
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self._stdin_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C at the terminal must not hit it before we decide
        )
        self._send(json.dumps(self.job))
        self._stderr_reader = threading.Thread(target=self._pump_stderr, daemon=True)
        self._threads = [threading.Thread(target=self._pump_events, daemon=True), self._stderr_reader]
        for thread in self._threads:
            thread.start()

    def _send(self, line: str) -> None:
        with self._stdin_lock:
            try:
                self.proc.stdin.write((line + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass

    def _pump_events(self) -> None:
        for raw in self.proc.stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                # Not from the agent (a login banner, a shell message): keep it visible.
                event = {"t": "out", "rank": None, "line": raw.decode("utf-8", "replace").rstrip("\n")}
            self.events.put((self.host, event))
        self._stderr_reader.join(timeout=1.0)  # ssh's own last words explain a lost session
        rc = self.proc.wait()
        self.events.put((self.host, {"t": "gone", "rc": rc, "stderr": list(self.stderr_tail)}))

    def _pump_stderr(self) -> None:
        for raw in self.proc.stderr:
            self.stderr_tail.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def stop(self) -> None:
        self._send("stop")

    def finish(self) -> None:
        """Wait for the agent to end its workers; if it does not, close the session (EOF ends them)."""
        if self.proc is None:
            return
        self.stop()
        try:
            self.proc.wait(timeout=self.grace_s + 5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for thread in self._threads:
            thread.join(timeout=2.0)


# --- the supervisor -------------------------------------------------------------------------


class Supervisor:
    def __init__(self, plan: LaunchPlan, view, *, grace_s: float = 3.0, ssh_port: int | None = None,
                 ssh_options: list[str] | None = None, files: dict[str, str] | None = None):
        self.plan = plan
        self.view = view
        self.grace_s = grace_s
        self.events: queue.Queue = queue.Queue()
        self.channels = [
            AgentChannel(node, plan, self.events, grace_s, ssh_port, list(ssh_options or []), files)
            for node in plan.nodes
        ]
        self._interrupt = threading.Event()
        self._tails = {w.rank: collections.deque(maxlen=TAIL_LINES) for w in plan.workers}
        self._host_of = {w.rank: w.host for w in plan.workers}

    def interrupt(self) -> None:
        """Ctrl-C / SIGTERM: safe to call from a signal handler."""
        self._interrupt.set()

    def run(self) -> JobResult:
        log_dir = Path(self.plan.run_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        self._logs = {rank: open(log_dir / f"rank{rank}.log", "w", encoding="utf-8", buffering=1) for rank in self._tails}
        self._failure: Failure | None = None
        self._exit_codes: dict[int, int] = {}
        self._running = set(self._tails)
        self._stopping_since: float | None = None
        self.view.start()
        try:
            for channel in self.channels:
                channel.start()
            while self._running:
                if self._interrupt.is_set() and self._stopping_since is None:
                    self._stop_all()
                if self._stopping_since is not None and time.monotonic() - self._stopping_since > self.grace_s + 8.0:
                    break  # hosts that do not answer: finish() below closes their sessions
                try:
                    self._handle(*self.events.get(timeout=0.1))
                except queue.Empty:
                    continue
        finally:
            for channel in self.channels:
                channel.finish()
            self._drain()
            for log in self._logs.values():
                log.close()
            self.view.stop(self._failure is not None or self._interrupt.is_set())
        return JobResult(self._failure, self._interrupt.is_set(), self._exit_codes, self.plan.run_dir)

    def _handle(self, host: str, event: dict) -> None:
        kind, rank = event.get("t"), event.get("rank")
        if kind == "out":
            line = event.get("line", "")
            if rank in self._logs:
                self._logs[rank].write(line + "\n")
                self._tails[rank].append(line)
            self.view.on_output(host, rank if rank is not None else -1, line)
        elif kind == "tel":
            self.view.on_telemetry(host, event.get("line", "").encode())
        elif kind == "exit" and rank in self._running:
            rc = int(event["rc"])
            self._running.discard(rank)
            self._exit_codes[rank] = rc
            self.view.on_worker_exit(host, rank, rc)
            if rc != 0:
                # Only the first failure is the root cause: ranks that die after we began
                # stopping are its consequences (or our own TERM).
                self._fail(Failure(host, rank, describe_exit(rc), rc, list(self._tails[rank])))
        elif kind == "gone":
            lost = {r for r in self._running if self._host_of[r] == host}
            if lost:
                detail = "; ".join(event.get("stderr", [])[-3:]) or f"agent exit code {event.get('rc')}"
                self._fail(Failure(host, None, f"lost the connection to the host's agent ({detail})"))
            self._running -= lost

    def _fail(self, failure: Failure) -> None:
        if self._failure is None and self._stopping_since is None:
            self._failure = failure
            self._stop_all()

    def _drain(self) -> None:
        """Log the output and telemetry that arrived after the last exit event."""
        while True:
            try:
                host, event = self.events.get_nowait()
            except queue.Empty:
                return
            if event.get("t") in ("out", "tel"):
                self._handle(host, event)

    def _stop_all(self) -> None:
        self._stopping_since = time.monotonic()
        for channel in self.channels:
            channel.stop()
