"""The worker side of telemetry: sample memory, aggregate collectives, stream JSON lines.

Created once per process by ``zerorun.telemetry.get_recorder()`` when the launcher set
ZERORUN_TELEMETRY_FD. Three rules shape it:

* Training is never held up. Collective events only update counters under a lock (a few
  microseconds); they are flushed as one aggregate per sample, not one message each. Step
  records are queued and written by the sampling thread just before each sample. The pipe
  is non-blocking: what does not fit is kept in a bounded backlog, and whole messages are
  dropped when the backlog is full (the launcher is not reading: better blind than stalled).
* Nothing here raises into training: every write and every sample is wrapped.
* A rank blocked in a collective must still be seen, so a daemon thread sends a sample at a
  fixed interval naming the collective it is waiting in (see "blocked" in events.py).
"""

from __future__ import annotations

import atexit
import os
import resource
import stat
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from zerorun.telemetry import events

# A message only partly written stays in the backlog (its tail must follow, or the line is torn);
# beyond this many bytes new messages are dropped whole.
_BACKLOG_LIMIT = 256 * 1024
# Step records kept between two samples; beyond this (a sampler starved for minutes) the oldest go.
_MAX_PENDING_STEPS = 4096


class PipeWriter:
    """Non-blocking, drop-when-full writer of whole lines to a file descriptor. Thread-safe."""

    def __init__(self, fd: int):
        self.fd = fd
        self.dropped = 0
        self._backlog = b""
        self._lock = threading.Lock()
        self._broken = False
        try:
            os.set_blocking(fd, False)
        except OSError:
            self._broken = True

    def write(self, line: bytes) -> None:
        with self._lock:
            if self._broken:
                return
            self._drain()  # first make what room the reader has made since the last write
            if len(self._backlog) + len(line) > _BACKLOG_LIMIT:
                self.dropped += 1
                return
            self._backlog += line
            self._drain()

    def _drain(self) -> None:
        try:
            while self._backlog:
                written = os.write(self.fd, self._backlog)
                self._backlog = self._backlog[written:]
        except BlockingIOError:
            pass
        except OSError:
            # The reader went away (launcher gone, EPIPE): stop writing, keep training.
            self._broken = True
            self._backlog = b""


class Recorder:
    """Collects one worker's telemetry and writes it through a ``PipeWriter``.

    Observer of zerorun.zero.comm.collectives (collective_started / collective_finished) and the
    runtime's ``record_step`` / ``set_memory_breakdown`` target.
    """

    enabled = True  # NullRecorder says False: the engine skips its per-step telemetry work

    def __init__(self, writer: PipeWriter, *, token: str, rank: int, host: str, world_size: int,
                 interval_s: float = 1.0, clock=time.time):
        self.writer = writer
        self.interval_s = interval_s
        self._clock = clock
        self._envelope = {"v": events.VERSION, "token": token, "rank": rank, "host": host}
        self._world_size = world_size
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._comm: dict[str, list] = {}  # op -> [count, bytes, seconds] since the last sample
        # Note [bytes per link]: bytes this rank sent, [within its host, to other hosts], since
        # it started, and that total when the last step was recorded.
        self._sent = [0, 0]
        self._sent_at_step = (0, 0)
        # Wall seconds with at least one collective in flight (Note [comm share]).
        self._comm_seconds_total = 0.0
        self._busy_since: float | None = None
        # Note [comm share]: seconds the training thread (the one that records steps) was blocked
        # on collectives, and that total when the last step was recorded.
        self._waited_total = 0.0
        self._waited_at_step = 0.0
        self._training_thread = threading.get_ident()
        self._entered_seq = -1
        self._in_flight: dict[int, tuple[str, float]] = {}  # seq -> (op, monotonic start)
        self._breakdown: dict | None = None
        self._total_steps: int | None = None  # engine.set_total_steps(n): sent with every step
        self._activity: dict | None = None  # Note [saving is progress]
        # Steps wait here for the next sample (at most interval_s): one burst of writes per
        # interval, not a syscall per step in the training thread nor a launcher wake-up per step.
        self._pending_steps: deque = deque(maxlen=_MAX_PENDING_STEPS)
        self.steps_dropped = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._poll_collectives: Callable[[], None] | None = None  # collectives.poll_timings once started (Note [event ledger])

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Send hello, start the sampling thread, flush at exit; observe zerorun's collectives
        once their module is loaded (Note [any script is visible]: a worker's recorder starts
        before the script, and must not import torch before the script does)."""
        self._send("hello", pid=self._pid, world_size=self._world_size, **_device_info())
        self.observe_collectives()
        self._thread = threading.Thread(target=self._sample_loop, name="zerorun-telemetry", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def observe_collectives(self) -> None:
        """Subscribe to zerorun.zero.comm.collectives if something has imported it (idempotent;
        ``get_recorder`` calls it, so the engine's first collective is seen)."""
        if self._poll_collectives is not None:
            return
        collectives = sys.modules.get("zerorun.zero.comm.collectives")
        # Note [a module still importing]: the sampling thread can find the module in sys.modules
        # while the main thread is still executing it, before add_observer exists (a loaded machine
        # widens that window to seconds). Subscribing then raised AttributeError and ended the
        # sampling thread: no sample, step or save progress reached the launcher again, and its
        # hang watchdog ended a healthy job. Such a module is left for the next sample.
        if collectives is None or getattr(getattr(collectives, "__spec__", None), "_initializing", False) \
                or not hasattr(collectives, "add_observer") or not hasattr(collectives, "poll_timings"):
            return
        collectives.add_observer(self)
        self._poll_collectives = collectives.poll_timings

    def close(self) -> None:
        """Stop sampling and send a last sample and a ``bye`` (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._poll()  # what the GPU finished by now is still told to this recorder
        collectives = sys.modules.get("zerorun.zero.comm.collectives")
        if collectives is not None:
            collectives.remove_observer(self)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval_s + 1)
        self.send_sample()
        self._send("bye")

    # --- runtime contract --------------------------------------------------------------
    def record_step(self, *, step: int, step_time_s: float, loss=None, loss_scale=None, lr=None,
                    samples=None, tokens=None, **_ignored) -> None:
        if os.getpid() != self._pid:  # a forked child (e.g. a DataLoader worker) stays silent
            return
        self._poll()  # the step's collectives the GPU has finished, timed by their events
        try:
            with self._lock:
                self._training_thread = threading.get_ident()
                waited, self._waited_at_step = self._waited_total - self._waited_at_step, self._waited_total
                sent = (self._sent[0] - self._sent_at_step[0], self._sent[1] - self._sent_at_step[1])
                self._sent_at_step = (self._sent[0], self._sent[1])
            message = {**self._envelope, "kind": "step", "t": self._clock(), "step": int(step),
                       "step_time_s": float(step_time_s), "loss": _number(loss), "loss_scale": _number(loss_scale),
                       "lr": _number(lr), "samples": _number(samples), "tokens": _number(tokens),
                       "waited_s": round(min(waited, float(step_time_s)), 6),
                       "sent_within": sent[0], "sent_between": sent[1]}
            if self._total_steps is not None:
                message["total_steps"] = self._total_steps
            with self._lock:
                if len(self._pending_steps) == self._pending_steps.maxlen:
                    self.steps_dropped += 1  # the oldest goes: the sampler has not run for a long time
                self._pending_steps.append(message)
        except Exception:
            pass

    def set_total_steps(self, total_steps: int) -> None:
        """The run's optimizer steps, for the dashboard's progress bar and ETA."""
        self._total_steps = int(total_steps)

    def record_activity(self, what: str | None, nbytes: int) -> None:
        """Note [saving is progress]: long work with no step and no collective (writing or
        consolidating a checkpoint: minutes on slow storage) reports what it is doing and the
        bytes done so far; every sample carries it as ``activity`` while it lasts, so the
        launcher's hang watchdog can see it move. ``what`` None: the work ended."""
        with self._lock:
            self._activity = None if what is None else {"what": str(what), "bytes": int(nbytes)}

    def announce_monitor(self, section: dict) -> None:
        """The config's ``monitor`` section, sent once by rank 0 (zerorun.telemetry.announce_monitor)."""
        try:
            self._send("monitor", monitor=section)
        except Exception:
            pass

    def set_memory_breakdown(self, breakdown: dict) -> None:
        with self._lock:
            self._breakdown = {str(k): _number(v) for k, v in dict(breakdown).items()}

    # --- collectives observer ----------------------------------------------------------
    # Note [comm share]: the comm share shown everywhere (dashboard, summary, report) is the time a
    # step waited for communication over the step's time: each step record carries ``waited_s``,
    # the seconds the training thread spent blocked on collectives since the previous step (a
    # blocking collective from issue to end, an asynchronous one inside its wait()). Summing each
    # collective's issue-to-completion time instead counted asynchronous collectives, and the
    # compute they overlap, several times over (all-gather 5.4 s + reduce-scatter 6.3 s in a
    # 6.2 s loop); even the union of those intervals counted overlapped time as if exposed
    # ("comm 90%"). Waits in other threads (the offload worker) do not hold the step. The
    # per-op seconds (summary table) stay issue-to-completion sums on the CPU, labelled so; on
    # NCCL they are each collective's transfer, timed by CUDA events on the communication stream
    # and reported once the GPU finished it (Note [streams] in zero/comm/collectives.py), and the
    # host's (tiny) blocked time arrives apart, in collective_waited. The samples'
    # comm_seconds_total (the union) is kept in metrics.jsonl for reading overlap; on NCCL its
    # intervals run from when a poll saw the GPU begin a collective to when one saw it finish.
    def collective_started(self, seq: int, op: str, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            if not self._in_flight:
                self._busy_since = now
            self._in_flight[seq] = (op, now)
            if seq > self._entered_seq:
                self._entered_seq = seq

    def collective_waited(self, seq: int, op: str, waited: float) -> None:
        """A collective timed by events (NCCL): the host's blocked time, from the waiting thread;
        its seconds come later in ``collective_finished`` (Note [streams] in collectives.py)."""
        with self._lock:
            if threading.get_ident() == self._training_thread:
                self._waited_total += max(0.0, float(waited))

    # Note [bytes per link]: each collective tells, when issued, the bytes this rank sends in it to
    # ranks of its own host and to other hosts (Note [link classes] in zero/comm/link_split.py).
    # Every step record carries what was sent since the previous one (``sent_within``,
    # ``sent_between``; the first step also holds what initialize sent), every sample the totals
    # since the start (``sent``): the dashboard's, the summary's and ``zerorun report``'s
    # bytes per step on each link class. Every thread's collectives count: bytes are bytes.
    def collective_sent(self, seq: int, op: str, within: int, between: int) -> None:
        with self._lock:
            self._sent[0] += int(within)
            self._sent[1] += int(between)

    def collective_finished(self, seq: int, op: str, nbytes: int, seconds: float, waited: float = 0.0) -> None:
        with self._lock:
            self._in_flight.pop(seq, None)
            if threading.get_ident() == self._training_thread:
                self._waited_total += max(0.0, float(waited))
            totals = self._comm.get(op)
            if totals is None:
                totals = self._comm[op] = [0, 0, 0.0]
            totals[0] += 1
            totals[1] += int(nbytes)
            totals[2] += float(seconds)
            if not self._in_flight and self._busy_since is not None:
                self._comm_seconds_total += time.monotonic() - self._busy_since
                self._busy_since = None

    # --- sampling ----------------------------------------------------------------------
    def send_sample(self) -> None:
        if os.getpid() != self._pid:
            return
        self._poll()  # a collective the GPU finished is not shown in flight, nor counted late
        try:
            mem = sample_memory()
            with self._lock:
                steps = list(self._pending_steps)
                self._pending_steps.clear()
                comm, self._comm = self._comm, {}
                blocked = self._oldest_in_flight()
                busy = self._comm_seconds_total
                if self._busy_since is not None:  # a collective still out: count its time so far
                    busy += time.monotonic() - self._busy_since
                fields = dict(mem=mem, comm=comm, comm_seconds_total=busy,
                              entered_seq=self._entered_seq, blocked=blocked, sent=list(self._sent))
                if self._breakdown is not None:
                    fields["breakdown"] = self._breakdown
                if self._activity is not None:
                    fields["activity"] = dict(self._activity)
            for message in steps:
                self.writer.write(events.encode(message))
            self._send("sample", **fields)
        except Exception:
            pass

    def _poll(self) -> None:
        """Ask the collectives module what the GPU has begun or finished (Note [event ledger] in
        zero/comm/event_ledger.py: event queries, never a wait); nothing on the CPU."""
        if self._poll_collectives is not None:
            try:
                self._poll_collectives()
            except Exception:
                pass

    def _oldest_in_flight(self) -> dict | None:
        if not self._in_flight:
            return None
        seq = min(self._in_flight)
        op, since = self._in_flight[seq]
        return {"seq": seq, "op": op, "for_s": round(time.monotonic() - since, 3)}

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.observe_collectives()
            except Exception:
                pass  # never end the sampling thread over it: the next sample tries again
            self.send_sample()

    def _send(self, kind: str, **fields) -> None:
        message = {**self._envelope, "kind": kind, "t": self._clock(), **fields}
        self.writer.write(events.encode(message))


def sample_memory() -> dict:
    """This process's memory now, in bytes; keys follow events.py, absent when unknown."""
    import psutil

    mem = {"rss": psutil.Process().memory_info().rss}
    # ru_maxrss is the kernel's true peak (KiB on Linux, bytes on macOS), not our sampled max.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # The kernel updates its high-water mark lazily, so it can trail the current RSS a little.
    mem["rss_peak"] = max(mem["rss"], peak if sys.platform == "darwin" else peak * 1024)
    torch = sys.modules.get("torch")  # never import torch just to look at it
    index = _cuda_index(torch) if torch is not None and _may_use_cuda() and torch.cuda.is_initialized() else None
    if torch is not None and index is not None:
        # This worker's GPU by name: this thread's current device is cuda:0 whatever the main
        # thread chose, so a bare memory_allocated() read GPU 0 on every rank.
        mem["cuda_allocated"] = torch.cuda.memory_allocated(index)
        mem["cuda_reserved"] = torch.cuda.memory_reserved(index)
        mem["cuda_peak"] = torch.cuda.max_memory_allocated(index)
        try:
            pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current")
            if pinned is not None:
                mem["pinned"] = int(pinned)
        except Exception:
            pass
    return mem


def _may_use_cuda(environ=os.environ) -> bool:
    """False for a worker the launcher made a CPU worker: it never touches torch.cuda
    (Note [device contract] in zerorun/worker/device.py)."""
    from zerorun.worker.device import uses_cuda, worker_device

    return uses_cuda(worker_device(environ))


def _cuda_index(torch, environ=os.environ) -> int | None:
    """This worker's GPU by the device contract, or None (a CPU worker, or an environment that
    names a GPU it does not have: telemetry says cpu rather than fail the worker). Once the
    engine bound its device, that one: the environment alone misses the group and the model's
    device (a script's gloo group beside a model it built on a GPU)."""
    from zerorun.errors import ZerorunError
    from zerorun.worker.device import bound, choose_device

    chosen = bound()  # the engine's choice, group and model included, once initialize made it
    if chosen is not None:
        return chosen.index
    try:
        choice = choose_device(environ, lambda: torch.cuda.device_count() if torch.cuda.is_available() else 0)
    except ZerorunError:
        return None
    return choice.index


def _device_info(environ=os.environ) -> dict:
    import psutil

    info = {"device": "cpu", "host_total_bytes": psutil.virtual_memory().total}
    torch = sys.modules.get("torch")
    if not _may_use_cuda(environ) or torch is None:
        return info
    try:
        index = _cuda_index(torch, environ)
        if index is None:
            return info
        total = torch.cuda.get_device_properties(index).total_memory
        info["device"], info["device_total_bytes"] = f"cuda:{index}", total
    except Exception:
        pass
    return info


def _number(value):
    """Floats for JSON: tensors and numpy scalars become plain numbers, anything else None."""
    if value is None:
        return None
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        return None


def recorder_from_env(env=os.environ) -> Recorder | None:
    """A started Recorder when the launcher passed a telemetry fd (and the run's config.json
    does not say ``telemetry: {enabled: false}``), else None. The sampling interval is
    ZERORUN_TELEMETRY_INTERVAL, else the config's ``telemetry.interval_s``."""
    fd = env.get("ZERORUN_TELEMETRY_FD")
    if not fd:
        return None
    # Note [any script is visible]: only the worker itself reports. A process it starts (a
    # DataLoader worker spawned, a compiler, a subprocess of the script) does not get the pipe;
    # the variable is taken out of the worker's environment below, so it does not inherit that
    # either, and an fd of that number that is no pipe is never written to.
    try:
        if not stat.S_ISFIFO(os.fstat(int(fd)).st_mode):
            return None
    except (OSError, ValueError):
        return None
    from zerorun.telemetry.settings import telemetry_config

    config = telemetry_config(env.get("ZERORUN_CONFIG"))
    if not config.enabled:
        return None
    try:
        interval = float(env.get("ZERORUN_TELEMETRY_INTERVAL") or config.interval_s)
        writer = PipeWriter(int(fd))
        recorder = Recorder(
            writer,
            token=env.get("ZERORUN_RUN_TOKEN", ""),
            rank=int(env.get("RANK", "0")),
            host=env.get("ZERORUN_HOST") or _hostname(),
            world_size=int(env.get("WORLD_SIZE", "1")),
            interval_s=interval if interval > 0 else 1.0,
        )
    except (ValueError, OSError):
        return None
    recorder.start()
    if env is os.environ:
        os.environ.pop("ZERORUN_TELEMETRY_FD", None)  # this process's alone (above)
    return recorder


def _hostname() -> str:
    import socket

    return socket.gethostname()
