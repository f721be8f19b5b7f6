"""The launcher side of telemetry: check every line, keep per-rank state, write metrics.jsonl.

``Collector.ingest(host, raw_line)`` is the only door in. A line is accepted only if it is at
most 64 KiB, UTF-8 JSON (never pickle: nothing here can execute what a peer sends), carries
this run's token (compared in constant time) and follows events.py's schema. Anything else is
counted under a reason and dropped; the run goes on. Accepted messages have every string
stripped of control characters (sanitize.py: op names and hosts reach the terminal), update
the per-rank state and are appended to RUN_DIR/metrics.jsonl without the token. The rank a
message names has been stamped by the host's agent, which knows which pipe it came from
(agent.stamp_telemetry), so a worker cannot write records for another rank.

``Collector.snapshot()`` returns frozen plain data that ui/render.py draws. The judgements the
dashboard shows (stragglers, hangs, throughput) are pure functions at the bottom of this file.
"""

from __future__ import annotations

import hmac
import json
import statistics
import threading
import time
from typing import TextIO
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from zerorun.telemetry import events
from zerorun.telemetry.sanitize import clean_strings

DROP_REASONS = ("oversized", "malformed", "unauthenticated", "schema")
# How many recent steps / samples the rates are computed over: long enough to smooth noise,
# short enough that the dashboard follows a slowdown within a few seconds.
_STEP_WINDOW = 10


@dataclass(frozen=True)
class Blocked:
    """A rank waiting inside collective ``seq`` for ``waited_s`` seconds (as of the snapshot)."""

    seq: int
    op: str
    waited_s: float


@dataclass(frozen=True)
class CommStat:
    op: str
    count: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class RankView:
    rank: int
    host: str
    device: str = "?"
    step: int | None = None
    loss: float | None = None
    lr: float | None = None
    loss_scale: float | None = None
    step_time_s: float | None = None
    samples_per_s: float | None = None  # over the recent steps (the live rate)
    tokens_per_s: float | None = None
    # Over every step of the run: what the end-of-run summary and ``zerorun report`` show.
    run_samples_per_s: float | None = None
    run_comm_fraction: float | None = None
    # The figure the dashboard bars: GPU allocated on CUDA, resident set size on CPU.
    mem_label: str = "rss"
    mem_used: int | None = None
    mem_peak: int | None = None
    mem_capacity: int | None = None
    mem: tuple = ()  # (key, bytes) pairs of the latest sample, as sent
    breakdown: tuple = ()  # (name, bytes) pairs from engine.memory_breakdown(), as sent
    # Note [comm share] in recorder.py: the recent steps' waited time over their step time.
    comm_fraction: float | None = None
    bandwidth_bps: float | None = None
    comm: tuple[CommStat, ...] = ()
    # Bytes sent per step, (within its host, to other hosts): the median of the recent steps,
    # and of every step of the run (the summary's); None before a step said (Note [bytes per
    # link] in recorder.py).
    sent_per_step: tuple[float, float] | None = None
    run_sent_per_step: tuple[float, float] | None = None
    heartbeat_age_s: float | None = None
    entered_seq: int | None = None
    blocked: Blocked | None = None
    # (what, bytes so far) of long work outside steps and collectives, e.g. ("saving", n):
    # Note [saving is progress] in recorder.py. The hang watchdog counts a change as progress.
    activity: tuple | None = None
    exit_code: int | None = None
    straggler: bool = False


@dataclass(frozen=True)
class Hang:
    """Collective ``seq`` (``op``) has kept ``waiting`` ranks for ``waited_s``; ``missing`` never entered it."""

    seq: int
    op: str
    waited_s: float
    waiting: tuple[int, ...]
    missing: tuple[int, ...]


@dataclass(frozen=True)
class Snapshot:
    world_size: int
    elapsed_s: float
    ranks: tuple[RankView, ...]
    step: int | None = None
    total_steps: int | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    run_samples_per_s: float | None = None
    # The mean over ranks of each rank's own loss at ``step`` (the global batch's loss when the
    # ranks' batches are equal): what a script printing the all-reduced loss prints.
    mean_loss: float | None = None
    hang: Hang | None = None
    output: tuple[tuple[int, str], ...] = ()
    dropped: tuple[tuple[str, int], ...] = ()
    accepted: int = 0
    comm_totals: tuple[CommStat, ...] = ()


@dataclass
class _RankState:
    rank: int
    host: str = "?"
    device: str = "?"
    host_total: int | None = None
    device_total: int | None = None
    last_seen: float | None = None  # collector's monotonic clock
    mem: dict = field(default_factory=dict)
    breakdown: dict = field(default_factory=dict)
    comm: dict = field(default_factory=dict)  # op -> [count, bytes, seconds], cumulative
    # (step_time_s, samples, tokens, waited_s) of the recent steps, and of every step summed
    steps: deque = field(default_factory=lambda: deque(maxlen=_STEP_WINDOW))
    run_steps: list = field(default_factory=lambda: [0.0, 0.0, 0.0])  # step time, samples, waited
    run_complete: list = field(default_factory=lambda: [True, True])  # every step had samples / waited_s
    losses: deque = field(default_factory=lambda: deque(maxlen=_STEP_WINDOW))  # (step, loss)
    # (sent_within, sent_between) of the recent steps, and of every step of the run
    sent: deque = field(default_factory=lambda: deque(maxlen=_STEP_WINDOW))
    run_sent: list = field(default_factory=list)
    last_step: dict | None = None
    last_step_seen: float | None = None  # collector's clock, when the last step arrived
    entered_seq: int | None = None
    blocked: dict | None = None
    blocked_seen: float | None = None
    activity: tuple | None = None
    exit_code: int | None = None


class Collector:
    """Thread-safe store of everything the workers reported. See the module docstring."""

    def __init__(self, *, token: str, world_size: int, run_dir: Path | None = None,
                 total_steps: int | None = None, hang_after_s: float = 30.0,
                 output_lines: int = 200, clock=time.monotonic, listener=None):
        """``listener``: called with every accepted record (token removed), after the collector
        applied it and outside its lock: the launcher's monitor writer (telemetry/monitor.py)."""
        self.listener = listener
        self.world_size = world_size
        self.total_steps = total_steps
        self.hang_after_s = hang_after_s
        self.metrics_path = Path(run_dir) / "metrics.jsonl" if run_dir is not None else None
        self._token = token.encode()
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._ranks = {r: _RankState(r) for r in range(world_size)}
        self._output: deque = deque(maxlen=output_lines)
        self._dropped = dict.fromkeys(DROP_REASONS, 0)
        self._accepted = 0
        self._metrics_file: TextIO | None = None
        self._straggling_since: dict[int, float] = {}  # Note [a lag that lasts]

    # --- input -------------------------------------------------------------------------
    def ingest(self, host: str, raw_line: bytes | str) -> bool:
        """Check one raw line; apply and record it if valid. Returns whether it was accepted."""
        if isinstance(raw_line, str):
            raw_line = raw_line.encode("utf-8", "surrogateescape")
        if len(raw_line) > events.MAX_LINE_BYTES:
            return self._drop("oversized")
        try:
            message = json.loads(raw_line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return self._drop("malformed")
        if not isinstance(message, dict):
            return self._drop("malformed")
        token = message.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self._token):
            return self._drop("unauthenticated")
        try:
            events.validate(message, self.world_size)
        except (events.SchemaError, ValueError, TypeError, OverflowError):
            return self._drop("schema")
        del message["token"]  # the token never reaches the disk
        message = clean_strings(message)
        with self._lock:
            try:
                self._apply(message)
            except Exception:
                self._dropped["schema"] += 1
                return False
            self._accepted += 1
            try:
                self._append(message)
            except OSError:
                pass  # disk full or run dir gone: the file misses a record, the dashboard goes on
        if self.listener is not None:
            self.listener(message)
        return True

    def add_output(self, rank: int, line: str) -> None:
        with self._lock:
            self._output.append((rank, line))

    def worker_exited(self, rank: int, returncode: int) -> None:
        with self._lock:
            if rank in self._ranks:
                self._ranks[rank].exit_code = returncode
                self._ranks[rank].blocked = None

    def close(self) -> None:
        with self._lock:
            if self._metrics_file is not None:
                self._metrics_file.close()
                self._metrics_file = None

    def count_dropped(self, reason: str, count: int = 1) -> None:
        """Lines dropped before they reached ``ingest`` (by the agent: oversized)."""
        with self._lock:
            self._dropped[reason if reason in self._dropped else "malformed"] += count

    def _drop(self, reason: str) -> bool:
        with self._lock:
            self._dropped[reason] += 1
        return False

    def _append(self, message: dict) -> None:
        if self.metrics_path is None:
            return
        if self._metrics_file is None:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self._metrics_file = open(self.metrics_path, "a", buffering=1)  # line-buffered: tail -f works
        self._metrics_file.write(json.dumps(message, separators=(",", ":")) + "\n")

    def _apply(self, m: dict) -> None:
        state = self._ranks[m["rank"]]
        state.host = m["host"]
        now = self._clock()
        state.last_seen = now
        kind = m["kind"]
        if kind == "hello":
            state.device = m["device"]
            state.host_total = m.get("host_total_bytes")
            state.device_total = m.get("device_total_bytes")
        elif kind == "step":
            state.last_step = m
            state.last_step_seen = now
            state.steps.append((m["step_time_s"], m.get("samples"), m.get("tokens"), m.get("waited_s")))
            _add_to_run(state, m)
            if m.get("loss") is not None:
                state.losses.append((m["step"], m["loss"]))
            if m.get("sent_within") is not None and m.get("sent_between") is not None:
                state.sent.append((m["sent_within"], m["sent_between"]))
                state.run_sent.append((m["sent_within"], m["sent_between"]))
        elif kind == "sample":
            state.mem = m["mem"]
            if m.get("breakdown"):
                state.breakdown = m["breakdown"]
            for op, (count, nbytes, seconds) in m["comm"].items():
                totals = state.comm.setdefault(op, [0, 0, 0.0])
                totals[0] += count
                totals[1] += nbytes
                totals[2] += seconds
            state.entered_seq = m["entered_seq"]
            state.blocked = m.get("blocked")
            state.blocked_seen = now
            activity = m.get("activity")
            state.activity = (activity["what"], activity["bytes"]) if activity else None

    # --- output ------------------------------------------------------------------------
    def _lasting(self, candidates: set[int], now: float) -> set[int]:
        """Note [a lag that lasts]: the ranks that have looked like stragglers for at least
        STRAGGLER_LASTING_S. Steps reach the launcher in bursts, one per sampling interval and
        rank, so in a healthy job one rank's reported step trails another's by up to a second
        (two or more steps of a fast loop), and one sample's comm shares swing: judged on one
        snapshot, 5 of 6 status lines of a healthy 3,000-step run said STRAGGLER."""
        self._straggling_since = {rank: self._straggling_since.get(rank, now) for rank in candidates}
        return {rank for rank, since in self._straggling_since.items() if now - since >= STRAGGLER_LASTING_S}

    def snapshot(self, output_lines: int = 20) -> Snapshot:
        with self._lock:
            now = self._clock()
            views = [_rank_view(s, now, self.hang_after_s) for s in self._ranks.values()]
            hang = detect_hang(views, self.hang_after_s)
            stragglers = self._lasting(find_stragglers(views), now) | set(hang.missing if hang else ())
            # A rank that has exited holds nobody back any more (its exit code tells its story).
            views = [_with_straggler(v, v.rank in stragglers and v.exit_code is None) for v in views]
            steps = [v.step for v in views if v.step is not None]
            return Snapshot(
                world_size=self.world_size,
                elapsed_s=now - self._started,
                ranks=tuple(views),
                step=min(steps) if steps else None,
                total_steps=self.total_steps or _reported_total(self._ranks.values()),
                samples_per_s=_sum_known(v.samples_per_s for v in views),
                run_samples_per_s=_sum_known(v.run_samples_per_s for v in views),
                mean_loss=mean_loss(self._ranks.values(), min(steps)) if steps else None,
                tokens_per_s=_sum_known(v.tokens_per_s for v in views),
                hang=hang,
                output=tuple(list(self._output)[-output_lines:]) if output_lines else (),
                dropped=tuple(self._dropped.items()),
                accepted=self._accepted,
                comm_totals=merge_comm(v.comm for v in views),
            )


def _rank_view(s: _RankState, now: float, stale_after_s: float = float("inf")) -> RankView:
    last = s.last_step or {}
    step_time = samples_rate = tokens_rate = None
    # A running rank with no step for longer than a hang takes has no current rate: showing
    # the last one would tell a hung job's user it is still training. Once it has exited, its
    # rate is history again (the end-of-run summary).
    stale = s.exit_code is None and s.last_step_seen is not None and now - s.last_step_seen > stale_after_s
    if s.steps and not stale:
        total_time = sum(t for t, _, _, _ in s.steps)
        step_time = total_time / len(s.steps)
        samples_rate = _rate([n for _, n, _, _ in s.steps], total_time)
        tokens_rate = _rate([n for _, _, n, _ in s.steps], total_time)
    run_time, run_samples, run_waited = s.run_steps
    run_rate = run_samples / run_time if s.run_complete[0] and run_samples and run_time > 0 else None
    run_comm = comm_fraction([(run_time, run_waited if s.run_complete[1] else None)])
    recent_comm = comm_fraction([(t, w) for t, _, _, w in s.steps])
    run_sent = sent_per_step(s.run_sent)
    recent_sent = None if stale else sent_per_step(list(s.sent))
    if s.exit_code is not None and s.steps:
        # Ended: the last frame, the summary and ``zerorun report`` show the run's figures alike.
        samples_rate, recent_comm, recent_sent = run_rate, run_comm, run_sent
    on_gpu = "cuda_allocated" in s.mem
    blocked = None
    if s.blocked is not None:
        seen = now if s.blocked_seen is None else s.blocked_seen  # set together with blocked
        blocked = Blocked(s.blocked["seq"], s.blocked["op"], s.blocked["for_s"] + (now - seen))
    comm = tuple(CommStat(op, c, b, sec) for op, (c, b, sec) in sorted(s.comm.items()))
    total_bytes = sum(c.nbytes for c in comm)
    total_seconds = sum(c.seconds for c in comm)
    return RankView(
        rank=s.rank,
        host=s.host,
        device=s.device,
        step=last.get("step"),
        loss=last.get("loss"),
        lr=last.get("lr"),
        loss_scale=last.get("loss_scale"),
        step_time_s=step_time,
        samples_per_s=samples_rate,
        tokens_per_s=tokens_rate,
        run_samples_per_s=run_rate,
        run_comm_fraction=run_comm,
        mem_label="gpu" if on_gpu else "rss",
        mem_used=s.mem.get("cuda_allocated" if on_gpu else "rss"),
        mem_peak=s.mem.get("cuda_peak" if on_gpu else "rss_peak"),
        mem_capacity=s.device_total if on_gpu else s.host_total,
        mem=tuple(sorted(s.mem.items())),
        breakdown=tuple(s.breakdown.items()),
        comm_fraction=recent_comm,
        bandwidth_bps=total_bytes / total_seconds if total_seconds > 0 else None,
        comm=comm,
        sent_per_step=recent_sent,
        run_sent_per_step=run_sent,
        heartbeat_age_s=None if s.last_seen is None else now - s.last_seen,
        entered_seq=s.entered_seq,
        blocked=blocked,
        activity=s.activity,
        exit_code=s.exit_code,
    )


def _add_to_run(state: _RankState, m: dict) -> None:
    """Every step into the run's totals: one definition of samples/s and comm share for the
    summary and ``zerorun report`` (telemetry/metrics.py folds the same records the same way)."""
    state.run_steps[0] += m["step_time_s"]
    for i, key in ((1, "samples"), (2, "waited_s")):
        if m.get(key) is None:
            state.run_complete[i - 1] = False
        else:
            state.run_steps[i] += m[key]


def mean_loss(states, step: int) -> float | None:
    """The ranks' own losses at ``step`` averaged; None unless every rank reported one for it."""
    losses = [dict(s.losses).get(step) for s in states]
    known = [loss for loss in losses if loss is not None]
    if not known or len(known) != len(losses):
        return None
    return sum(known) / len(known)


def _with_straggler(view: RankView, straggler: bool) -> RankView:
    from dataclasses import replace

    return replace(view, straggler=straggler) if straggler else view


def _rate(counts: list, seconds: float) -> float | None:
    known = [c for c in counts if c is not None]
    if not known or len(known) != len(counts) or seconds <= 0:
        return None
    return sum(known) / seconds


def _reported_total(states) -> int | None:
    """The total steps a worker named with engine.set_total_steps (used when the launcher knows none)."""
    totals = [s.last_step.get("total_steps") for s in states if s.last_step]
    totals = [int(t) for t in totals if t]
    return max(totals) if totals else None


def _sum_known(values) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


# --- pure judgements ---------------------------------------------------------------------
def comm_fraction(steps: list[tuple[float, float | None]]) -> float | None:
    """Share of step time spent waiting for collectives over (step_time_s, waited_s) pairs
    (Note [comm share] in recorder.py); None when a step did not say what it waited."""
    if not steps or any(waited is None for _, waited in steps):
        return None
    total = sum(t for t, _ in steps)
    if total <= 0:
        return None
    return min(1.0, max(0.0, sum(w for _, w in steps if w is not None) / total))


def sent_per_step(steps: list[tuple[int, int]]) -> tuple[float, float] | None:
    """(within host, between hosts) bytes sent per step over (sent_within, sent_between) pairs:
    each the median over the steps, so the first step (which also carries what initialize sent)
    and an odd step (an evaluation, a checkpoint's gather) do not move it; None without steps."""
    if not steps:
        return None
    return statistics.median(w for w, _ in steps), statistics.median(b for _, b in steps)


def merge_comm(per_rank) -> tuple[CommStat, ...]:
    """Sum CommStats by op across ranks."""
    totals: dict[str, list] = {}
    for stats in per_rank:
        for c in stats:
            t = totals.setdefault(c.op, [0, 0, 0.0])
            t[0] += c.count
            t[1] += c.nbytes
            t[2] += c.seconds
    return tuple(CommStat(op, *t) for op, t in sorted(totals.items()))


# A straggler shows as the rank that waits least: in synchronous data parallelism every other
# rank idles inside the collectives until it arrives. A gap of this much comm share marks it.
STRAGGLER_COMM_GAP = 0.15
# Or it is visibly behind: this many optimizer steps fewer than the leader.
STRAGGLER_STEP_LAG = 2
# Either for this long before the rank is tagged (Note [a lag that lasts]).
STRAGGLER_LASTING_S = 5.0


def find_stragglers(ranks: list[RankView]) -> set[int]:
    """Ranks that hold the others back (empty for a single rank or without data)."""
    if len(ranks) < 2:
        return set()
    slow: set[int] = set()
    steps = [r.step for r in ranks if r.step is not None]
    if steps:
        leader = max(steps)
        slow |= {r.rank for r in ranks if r.step is not None and leader - r.step >= STRAGGLER_STEP_LAG}
    shares = {r.rank: r.comm_fraction for r in ranks if r.comm_fraction is not None}
    for rank, share in shares.items():
        others = [o for other, o in shares.items() if other != rank]
        if others and statistics.median(others) - share >= STRAGGLER_COMM_GAP:
            slow.add(rank)
    return slow


def detect_hang(ranks: list[RankView], hang_after_s: float) -> Hang | None:
    """The earliest collective some rank has waited in for longer than ``hang_after_s``.

    Ranks whose highest entered collective is below its sequence number have not entered it
    (an SPMD program numbers its collectives the same on every rank); a rank that never sent
    a sample counts as not entered, because it may be stuck before its first collective.
    """
    blocked = [(r.rank, r.blocked) for r in ranks if r.blocked is not None]
    stuck = [b for _, b in blocked if b.waited_s > hang_after_s]
    if not stuck:
        return None
    seq = min(b.seq for b in stuck)
    waiting = [(rank, b) for rank, b in blocked if b.seq == seq]
    missing = tuple(r.rank for r in ranks if r.entered_seq is None or r.entered_seq < seq)
    return Hang(
        seq=seq,
        op=waiting[0][1].op,
        waited_s=max(b.waited_s for _, b in waiting),
        waiting=tuple(rank for rank, _ in waiting),
        missing=missing,
    )
