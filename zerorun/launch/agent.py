"""python -m zerorun.launch.agent   (started by the launcher over ssh; reads its job on stdin)

One agent per host spawns and supervises that host's workers. The local host runs the same
agent as a child process of the launcher (not over ssh), so local and remote workers are
started, read and ended by one code path, and a launcher killed outright still closes every
agent's stdin.

Protocol (JSON lines). stdin: first line is the node's job ``{"host", "cwd", "env",
"grace_s", "workers": [{"rank", "local_rank", "argv", "env"}]}``; afterwards ``stop`` ends
every worker, ``dump`` makes every worker print its Python stacks and end (SIGABRT with
faulthandler on: the hang report) and ``checkpoint`` sends every worker SIGUSR1, on which a
worker started with checkpoint.on_signal saves a checkpoint and stops (Note [Slurm signals] in
signals.py). The agent itself takes SIGUSR1/SIGUSR2 (Slurm's ``--signal`` without ``B:``
reaches the steps) as ``checkpoint`` when its workers save on signals, else as ``stop``. EOF on stdin (the ssh session is gone) also ends every
worker, so a launcher that dies cannot leave workers behind. stdout: events
    {"t": "joined", "rank"}              it has opened or reached the rendezvous (MASTER_PORT):
                                         its start-up is over (Note [start-up is not a hang])
    {"t": "out", "rank", "line"[, "more": true]}
                                         a line of its stdout/stderr; "more": the line goes on
                                         in the next event (cut at MAX_OUTPUT_LINE bytes)
    {"t": "tel", "rank", "line"}         one telemetry line it wrote to ZERORUN_TELEMETRY_FD,
                                         re-stamped with the rank and host the agent knows
    {"t": "tel_dropped", "rank", "reason"}  a telemetry line the agent dropped (oversized)
    {"t": "exit", "rank", "rc"}          it ended (after its last output line)
    {"t": "done"}                        every worker has ended; the agent exits
Telemetry rides this same stdout, so no port is opened on any host.

Note [workers die with their agent]: the launcher learns of a dead agent from its closed
stdout, but the workers would live on as children of PID 1. Two independent mechanisms end
them: each worker asks the kernel for SIGKILL when its parent (the agent) dies
(PR_SET_PDEATHSIG, set between fork and exec), and a guardian process in its own session
holds a pipe from the agent; when that pipe closes without the agent's "done", the guardian
ends every worker process group (which also reaches the workers' own children, which
PDEATHSIG does not). An agent that ends normally reaps every group first and then says "done",
so the guardian never signals a process group id the kernel may have handed out again. The
launcher then checks that no process of the run is left (processes.sweep_run).

Note [bounded output]: everything a worker writes is read in chunks of at most
MAX_OUTPUT_LINE bytes and written (blocking) to the agent's stdout, so a worker that prints
faster than the launcher reads is slowed by the full pipe instead of growing any buffer.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

import psutil

from zerorun.launch import early_signals
from zerorun.worker import save_on_signal
from zerorun.launch.processes import end_groups
from zerorun.telemetry.events import MAX_LINE_BYTES

# Output lines longer than this reach the launcher in pieces (the log file joins them again).
MAX_OUTPUT_LINE = 64 * 1024
# The collector drops longer telemetry lines anyway: dropping them here saves the transfer.
MAX_TELEMETRY_LINE = MAX_LINE_BYTES

Emit = Callable[[dict], None]
# Seconds an agent step waits, after Slurm's SIGTERM, for the launcher's verdict (checkpoint or
# stop) before stopping its workers anyway; less than the workers' own wait (save_on_signal).
TERM_VERDICT_WAIT_S = 8.0

# Runs as ``python -c GUARDIAN_SOURCE`` (stdlib only). stdin: "+PGID" when a worker group
# starts, "done" when the agent ends normally. EOF without "done" means the agent died.
GUARDIAN_SOURCE = r"""
import os, signal, sys, time
groups = set()
started = set()
for line in sys.stdin:
    word = line.strip()
    if word == "done":
        sys.exit(0)
    if word.startswith("+"):
        groups.add(int(word[1:]))
        started.add(int(word[1:]))
def signal_all(sig):
    for pgid in list(groups):
        try:
            os.killpg(pgid, sig)
        except OSError:
            groups.discard(pgid)
signal_all(signal.SIGTERM)
deadline = time.monotonic() + float(sys.argv[1])
while groups and time.monotonic() < deadline:
    time.sleep(0.05)
    signal_all(0)
signal_all(signal.SIGKILL)
# Note [shm cleanup] (zerorun/zero/comm/shm_names.py): the host-channel files of the workers.
import re
ours = re.compile(r"zerorun-(?:outbox|inbox)-p([0-9]+)-[A-Za-z0-9_]+\Z")
try:
    for name in os.listdir("/dev/shm"):
        found = ours.match(name)
        if found and int(found.group(1)) in started:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
except OSError:
    pass
"""


def _die_with_parent(parent_pid: int, prctl, hold_usr1: bool = False) -> Callable[[], None]:
    """The preexec hook of every worker: SIGKILL when the agent dies (Note [workers die with their agent]).

    ``hold_usr1`` (workers that save on signals): SIGUSR1 starts blocked, so one that comes before
    the worker's handler exists stays pending instead of killing it, and is delivered when
    ``zerorun.initialize`` arms the handler (save_on_signal.arm unblocks it; Note [signals from
    the first instant] in early_signals.py). A blocked signal mask survives exec."""

    def hook() -> None:
        if hold_usr1:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        if prctl is not None:
            prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the agent died before prctl took effect
            os._exit(137)

    return hook


def _libc_prctl():
    """libc's prctl on Linux (resolved once, in the parent: the fork child only calls it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


class Guardian:
    """The process that ends the worker groups if the agent dies (Note [workers die with their agent])."""

    def __init__(self, grace_s: float):
        self.proc: subprocess.Popen[bytes] | None = None
        self._stdin: IO[bytes] | None = None
        try:
            self.proc = proc = subprocess.Popen(
                [sys.executable, "-c", GUARDIAN_SOURCE, str(min(grace_s, 2.0))],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,  # a signal to the agent's group or session must not reach it
            )
        except OSError:
            pass
        else:
            if proc.stdin is None:  # asked for as a pipe, so Popen made one; checked once, here
                raise RuntimeError("the guardian process started without its stdin pipe")
            self._stdin = proc.stdin
        self._lock = threading.Lock()

    def tell(self, word: str) -> None:
        stdin = self._stdin
        if stdin is None:
            return
        with self._lock:
            try:
                stdin.write(f"{word}\n".encode())
                stdin.flush()
            except (OSError, ValueError):
                pass

    def release(self) -> None:
        """The agent ends normally: the guardian leaves without touching anything."""
        self.tell("done")
        if self.proc is not None and self._stdin is not None:
            try:
                self._stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass


class NodeAgent:
    """Starts one host's workers, streams their output/telemetry/exits to ``emit``, ends them."""

    def __init__(self, workers: list[dict], *, emit: Emit, cwd: str | None = None,
                 base_env: dict[str, str] | None = None, grace_s: float = 3.0, host: str | None = None,
                 guardian: Guardian | None = None):
        self.workers = workers
        self.emit = emit
        self.cwd = cwd
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.grace_s = grace_s
        self.host = host
        self.guardian = guardian
        self._procs: dict[int, subprocess.Popen] = {}
        self._waiters: list[threading.Thread] = []
        # The exit code of the first worker that failed before any stop was asked for: the
        # agent's own exit status, so a Slurm step of a failing node ends FAILED in accounting,
        # and the steps the launcher stopped because of it end as they were told.
        self.first_failure: int | None = None
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._preexec = _die_with_parent(os.getpid(), _libc_prctl(), hold_usr1=self.saves_on_signal)

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
                preexec_fn=self._preexec,
            )
        except (OSError, subprocess.SubprocessError) as err:
            os.close(read_fd)
            os.close(write_fd)
            self.emit({"t": "out", "rank": rank, "line": f"zerorun: cannot start {worker['argv'][0]}: {err}"})
            self.emit({"t": "exit", "rank": rank, "rc": 127})
            return
        os.close(write_fd)  # only the worker holds the write end: EOF when it is gone
        if self.guardian is not None:
            self.guardian.tell(f"+{proc.pid}")
        with self._stop_lock:
            self._procs[rank] = proc
            stopped = self._stopped
        if stopped:  # a stop raced with the spawn: end this worker at once
            end_groups([proc.pid], 0.0)
        if proc.stdout is None:  # asked for as a pipe, so Popen made one; checked once, here
            raise RuntimeError(f"rank {rank}'s worker started without its output pipe")
        output = self._thread(self._pump_output, rank, proc.stdout)
        port = env.get("MASTER_PORT", "")
        if port.isdigit():
            self._thread(self._watch_rendezvous, rank, proc, int(port))
        telemetry = self._thread(self._pump_telemetry, rank, read_fd)
        self._waiters.append(self._thread(self._await_exit, rank, proc, (output, telemetry)))

    def _thread(self, target, *args) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        return thread

    # -- reading ------------------------------------------------------------------------
    def _pump_output(self, rank: int, stream: IO[bytes]) -> None:
        """Note [bounded output]: a line without an end is sent in MAX_OUTPUT_LINE pieces."""
        while True:
            raw = stream.readline(MAX_OUTPUT_LINE)
            if not raw:
                break
            event = {"t": "out", "rank": rank}
            if raw.endswith(b"\n"):
                raw = raw[:-1]
                if raw.endswith(b"\r"):
                    raw = raw[:-1]
            else:
                event["more"] = True
            # surrogateescape: bytes that are not UTF-8 (or a character cut at a piece boundary)
            # travel as lone surrogates and become the same bytes again in the log file.
            event["line"] = raw.decode("utf-8", "surrogateescape")
            self.emit(event)
        stream.close()

    def _pump_telemetry(self, rank: int, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb") as stream:
            while True:
                raw = stream.readline(MAX_TELEMETRY_LINE + 1)
                if not raw:
                    return
                if len(raw) > MAX_TELEMETRY_LINE:
                    # Skip the rest of an oversized line; the launcher counts it as dropped.
                    while raw and not raw.endswith(b"\n"):
                        raw = stream.readline(MAX_TELEMETRY_LINE)
                    self.emit({"t": "tel_dropped", "rank": rank, "reason": "oversized"})
                    continue
                self.emit({"t": "tel", "rank": rank, "line": stamp_telemetry(raw, rank, self.host)})

    def _watch_rendezvous(self, rank: int, proc: subprocess.Popen, port: int) -> None:
        """Tell the launcher when the worker joins the rendezvous (Note [start-up is not a hang]):
        rank 0's store listens on MASTER_PORT, every other rank connects to it. Polled, a few
        times a second, only until then."""
        while proc.poll() is None:
            if socket_on_port(proc.pid, port):
                self.emit({"t": "joined", "rank": rank})
                return
            time.sleep(0.25)

    def _await_exit(self, rank: int, proc: subprocess.Popen, readers: tuple[threading.Thread, ...]) -> None:
        rc = proc.wait()
        with self._stop_lock:
            if rc != 0 and not self._stopped and self.first_failure is None:
                self.first_failure = rc
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

    def dump_stacks(self) -> None:
        """SIGABRT to every live worker: faulthandler (PYTHONFAULTHANDLER=1, set by the plan)
        prints every thread's Python stack to the worker's output, and the worker ends."""
        with self._stop_lock:
            procs = [proc for proc in self._procs.values() if proc.poll() is None]
        for proc in procs:
            try:
                # A stack, not a core file: SIGABRT would otherwise dump core where allowed.
                resource.prlimit(proc.pid, resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
            except (OSError, AttributeError, ValueError):
                pass
            try:
                os.kill(proc.pid, signal.SIGABRT)
            except OSError:
                pass

    def checkpoint(self) -> None:
        """SIGUSR1 to every live worker (the process, not its group: a data-loader child must
        not get it): its save_on_signal handler asks for a checkpoint at the next step."""
        with self._stop_lock:
            procs = [proc for proc in self._procs.values() if proc.poll() is None]
        for proc in procs:
            try:
                os.kill(proc.pid, signal.SIGUSR1)
            except OSError:
                pass

    @property
    def saves_on_signal(self) -> bool:
        return any(worker["env"].get(save_on_signal.ENV_NAME) == "1" for worker in self.workers)

    def remove_scratch(self) -> None:
        """The NVMe scratch its workers recorded and their host-channel files in /dev/shm (a
        rank ended by a signal cannot remove its own; Note [shm cleanup] in comm/shm_names.py)."""
        from zerorun.zero.comm.shm_names import remove_files_of
        from zerorun.worker.launch_env import LAUNCH_ID_ENV
        from zerorun.zero.offload.scratch import sweep_recorded

        with self._stop_lock:
            pids = [proc.pid for proc in self._procs.values()]
        remove_files_of(pids)

        # This launch's records only (Note [one launch per run directory] in launch/run_dir.py).
        by_run_dir: dict[tuple[str, str | None], list[int]] = {}
        for worker in self.workers:
            env = {**self.base_env, **worker["env"]}
            if env.get("ZERORUN_RUN_DIR"):
                by_run_dir.setdefault((env["ZERORUN_RUN_DIR"], env.get(LAUNCH_ID_ENV)), []).append(worker["rank"])
        for (run_dir, launch), ranks in by_run_dir.items():
            sweep_recorded(run_dir, ranks, launch)

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


def become_subreaper(prctl) -> bool:
    """Note [adopted orphans]: a worker may start a daemon in a session of its own with a clean
    environment (``setsid env -i ...``); it then leaves the worker's process group and carries
    no run token, so neither the group signals nor the launcher's sweep find it. As a child
    subreaper (PR_SET_CHILD_SUBREAPER), the agent inherits every orphan among its descendants
    instead of init, so at the end of the job everything still below the agent is this job's."""
    return prctl is not None and prctl(36, 1, 0, 0, 0) == 0  # 36 = PR_SET_CHILD_SUBREAPER


def end_adopted(spare: tuple[int, ...], grace_s: float) -> None:
    """TERM, then after ``grace_s`` KILL, every descendant of this process but ``spare``; reaped."""
    try:
        left = [p for p in psutil.Process().children(recursive=True) if p.pid not in spare]
    except psutil.Error:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        for proc in left:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        _, left = psutil.wait_procs(left, timeout=wait_s)
        if not left:
            return


def socket_on_port(pid: int, port: int) -> bool:
    """Whether process ``pid`` listens on or is connected to TCP ``port``."""
    try:
        connections = psutil.Process(pid).net_connections("tcp")
    except psutil.Error:
        return False
    return any((c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN)
               or (c.raddr and c.raddr.port == port) for c in connections)


def stamp_telemetry(raw: bytes, rank: int, host: str | None) -> str:
    """The line with ``rank`` (and ``host``) set to what the agent knows about its sender.

    A worker can write anything to its telemetry pipe; it must not be able to speak for
    another rank (its records would land under that rank in metrics.jsonl). A line that is
    not a JSON object goes on as it is: the collector counts it as malformed.
    """
    text = raw.decode("utf-8", "replace").rstrip("\n")
    try:
        message = json.loads(text)
    except (ValueError, RecursionError):
        return text
    if not isinstance(message, dict):
        return text
    message["rank"] = rank
    if host is not None:
        message["host"] = host
    return json.dumps(message, separators=(",", ":"))


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
    # Srun's signals (--signal=USR1@N without B:, scancel) can come while the job line is read:
    # remembered, then handled below (Note [signals from the first instant]).
    early_signals.install()
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
    grace_s = float(job.get("grace_s", 3.0))
    adopts_orphans = become_subreaper(_libc_prctl())
    guardian = Guardian(grace_s)
    agent = NodeAgent(
        job["workers"],
        emit=emit,
        cwd=job.get("cwd"),
        base_env={**os.environ, **job.get("env", {})},
        grace_s=grace_s,
        host=job.get("host"),
        guardian=guardian,
    )
    stop_requested = threading.Event()

    def request_stop(*_):
        # Called from a signal handler or the stdin watcher: hand the (blocking) teardown
        # to its own thread, once.
        if not stop_requested.is_set():
            stop_requested.set()
            threading.Thread(target=agent.stop, daemon=True).start()

    verdict = threading.Event()  # the launcher's "checkpoint" or "stop" after a SIGTERM

    def on_slurm_term(signum, _frame):
        # Note [a worker's SIGTERM under Slurm] (worker/save_on_signal.py): a preemption signals this
        # step, maybe not the launcher's. Tell the launcher (from a thread: emit takes a lock the
        # interrupted code may hold); with on_signal its verdict decides, else stop now.
        threading.Thread(target=emit, args=({"t": "signal", "sig": signum},), daemon=True).start()
        if not agent.saves_on_signal:
            request_stop()
            return
        waiting = threading.Timer(TERM_VERDICT_WAIT_S, lambda: None if verdict.is_set() else request_stop())
        waiting.daemon = True
        waiting.start()

    in_slurm = bool(os.environ.get("SLURM_JOB_ID"))
    handlers: dict[int, Callable] = {sig: request_stop for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    if in_slurm:
        handlers[signal.SIGTERM] = on_slurm_term
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        handlers[sig] = (lambda *_: agent.checkpoint()) if agent.saves_on_signal else request_stop
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    for signum in early_signals.take():
        handlers[signum](signum, None)

    def watch_stdin():
        # "dump" collects stacks, "checkpoint" asks for a save; any other line ("stop") or EOF (launcher or ssh session
        # gone) ends the job on this host.
        while True:
            line = sys.stdin.buffer.readline(64)
            if line.strip() == b"dump":
                agent.dump_stacks()
                continue
            if line.strip() == b"checkpoint":
                verdict.set()
                agent.checkpoint()
                continue
            verdict.set()
            request_stop()
            return

    threading.Thread(target=watch_stdin, daemon=True).start()
    agent.start()
    agent.wait()
    if broken.is_set():
        agent.stop()
    agent.reap_leftovers()
    agent.remove_scratch()
    if adopts_orphans:
        end_adopted((guardian.proc.pid,) if guardian.proc is not None else (), grace_s)
    guardian.release()
    emit({"t": "done"})
    return exit_status(agent.first_failure)


def exit_status(first_failure: int | None) -> int:
    """The agent's exit code from its first failed worker's (pure): that code, 128+N for a death
    by signal N (as a shell reports it), 0 when none failed on its own."""
    if first_failure is None:
        return 0
    return 128 - first_failure if first_failure < 0 else min(first_failure, 255)


if __name__ == "__main__":
    code = _serve()
    sys.stdout.flush()
    # Not sys.exit: the stdin watcher is a daemon thread blocked in a read of stdin, and the
    # interpreter's shutdown would abort on that stream's lock ("could not acquire lock").
    os._exit(code)
