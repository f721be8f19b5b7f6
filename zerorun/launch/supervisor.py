"""Runs a LaunchPlan: one node agent per host, events to the JobView and per-rank logs.

Every host is a *channel* (channel.py) to one agent process that delivers the agent protocol's
events (see agent.py): the local host's agent is a child process, remote hosts' run over ssh, so both
are started, read and stopped by the same code. Each channel's reader thread writes its
ranks' output straight to their log files and to the view (Note [bounded output] in agent.py:
nothing queues up in between, a slow reader slows the worker instead); only the few control
events (started, exit, gone) go through one queue to the supervisor, so ordering decisions
("which failure came first") are made in one place. The first worker to exit non-zero (or a
host whose agent is lost) is the root cause; every host is then told to stop (TERM, grace,
KILL by process group). A job in which nothing moves for the hang timeout is ended too, with
every rank's stack (Note [hang timeout] in watchdog.py).
"""

from __future__ import annotations

import collections
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from zerorun.launch import watchdog
from zerorun.launch.channel import AgentChannel, OutputSink
from zerorun.launch.failure_text import extract_traceback
from zerorun.launch.outcome import summary_ending
from zerorun.launch.plan import LaunchPlan
from zerorun.launch.processes import describe_exit
from zerorun.launch.supervision_state import Phase, SaveRequest, phase_tracker, save_tracker

TAIL_LINES = 400  # enough for a faulthandler dump of a few threads
# Exit codes of a rank ended by our own stop (TERM, then KILL): never a cause.
STOP_CODES = (-signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM, 128 + signal.SIGKILL)


@dataclass
class Failure:
    host: str
    rank: int | None
    reason: str
    returncode: int | None = None
    log_tail: list[str] = field(default_factory=list)
    # After a hang: every rank's main-thread stack, innermost frame first (Note [hang timeout]).
    stacks: dict[int, list[watchdog.Frame]] = field(default_factory=dict)

    @property
    def traceback(self) -> list[str]:
        return [] if self.stacks else extract_traceback(self.log_tail)


@dataclass
class JobResult:
    failure: Failure | None
    interrupted: bool
    exit_codes: dict[int, int]
    run_dir: str
    # Hosts where processes of the run could not be confirmed gone: host -> what is known.
    leftovers: dict[str, str] = field(default_factory=dict)
    # The signal that interrupted the launcher (SIGINT, SIGTERM), when interrupted.
    signal: int | None = None
    # The signal (SIGUSR1/2) on which every worker was asked to save a checkpoint and stop.
    checkpoint_signal: int | None = None
    # False when a signal came before any worker started (Note [signals from the first instant]).
    started: bool = True

    @property
    def ok(self) -> bool:
        return self.failure is None and not self.interrupted


# --- the supervisor -------------------------------------------------------------------------


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name



class Supervisor:
    def __init__(self, plan: LaunchPlan, view, *, grace_s: float = 3.0, ssh_port: int | None = None,
                 ssh_options: list[str] | None = None, files: dict[str, str] | None = None,
                 token: str = "", hang_timeout_s: float = 0.0, hang_warn_s: float = 0.0,
                 startup_timeout_s: float = 0.0, is_preemption: Callable[[], bool] | None = None,
                 slurm_ending: Callable[[], str | None] | None = None,
                 preempted_already: Callable[[], bool] | None = None):
        self.plan = plan
        self.view = view
        self.grace_s = grace_s
        self.token = token
        self.events: queue.Queue = queue.Queue()
        self.channels = [
            AgentChannel(node, plan, self.events, grace_s, ssh_port, list(ssh_options or []), files)
            for node in plan.nodes
        ]
        self._interrupt = threading.Event()
        self._tails: dict[int, collections.deque[str]] = {
            w.rank: collections.deque(maxlen=TAIL_LINES) for w in plan.workers}
        self._host_of = {w.rank: w.host for w in plan.workers}
        self._watch = watchdog.ProgressWatch(hang_timeout_s, time.monotonic(), ranks=tuple(self._tails),
                                             startup_timeout_s=startup_timeout_s)
        # One warning line per quiet spell, after hang_warn_s (telemetry.hang_after_s); 0 = none.
        self._hang_warn_s = hang_warn_s
        self._warned_at: float | None = None
        # Note [supervision states] in supervision_state.py: where the job is, and since when
        # (monotonic); the two DUMPING phases' data: the ranks missing from the collective others
        # wait in (a hang), the ranks still starting (the start-up limit; fixed then, because
        # ranks that end of the stack dump stop "starting" meanwhile).
        self._phase = phase_tracker()
        self._phase_since = 0.0
        self._hang_missing: tuple[int, ...] = ()
        self._starting_at_dump: list[int] = []
        self._lost_hosts: set[str] = set()
        self._signal: int | None = None
        # Written by the signal handlers (request_checkpoint); the loop moves ``_save`` from it.
        self._checkpoint_signal: int | None = None
        self._save = save_tracker()
        self._init_slurm(is_preemption, slurm_ending, preempted_already)

    def _init_slurm(self, is_preemption: Callable[[], bool] | None, slurm_ending: Callable[[], str | None] | None,
                    preempted_already: Callable[[], bool] | None) -> None:
        """What the supervisor asks Slurm, and what it learnt of Slurm's signals (None outside Slurm)."""
        # Under Slurm with checkpoint.on_signal: asks Slurm whether a SIGTERM is a preemption
        # (signals.slurm_stop_cause); None elsewhere, where SIGTERM always stops.
        self._is_preemption = is_preemption
        # Under Slurm: how Slurm is ending the job ("cancelled", "preempted", ...; None when it is
        # not), asked once at the end of a failed or signalled job for the summary's header.
        self._slurm_ending = slurm_ending
        # Under Slurm: whether the job's record shows a preemption, asked once every rank has
        # joined (Note [a preemption before the steps]).
        self._preempted_already = preempted_already
        self._joined: set[int] = set()
        # Facts, not states: an agent step reported Slurm's SIGTERM (then the job's record need
        # not be asked about a preemption), and a SIGTERM's meaning is being asked of Slurm (once).
        self._agent_term = False
        self._term_judged = False

    def interrupt(self, signum: int = 2) -> None:
        """Ctrl-C / SIGTERM: safe to call from a signal handler."""
        if not self._interrupt.is_set():
            self._signal = signum
        self._interrupt.set()

    def judge_term(self, signum: int) -> None:
        """SIGTERM, to the launcher or reported by an agent step (Note [a worker's SIGTERM under
        Slurm] in worker/save_on_signal.py): a preemption becomes a checkpoint request, anything else
        (scancel, the time limit) stops the job. Safe from a signal handler: Slurm is asked in a
        thread, once."""
        if self._is_preemption is None:
            self.interrupt(signum)
            return
        if self._term_judged:
            return
        self._term_judged = True
        is_preemption = self._is_preemption

        def decide() -> None:
            if is_preemption():
                self.request_checkpoint(signum)
            else:
                self.interrupt(signum)

        threading.Thread(target=decide, name="zerorun-judge-sigterm", daemon=True).start()

    def request_checkpoint(self, signum: int) -> None:
        """SIGUSR1/2 with checkpoint.on_signal: safe to call from a signal handler (Note [Slurm signals])."""
        if self._checkpoint_signal is None:
            self._checkpoint_signal = signum

    def run(self) -> JobResult:
        log_dir = Path(self.plan.run_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        # Line-buffered, so `tail -f` on a log follows the rank as it runs. Appended: a requeued
        # Slurm job continues its run directory (prepare.default_run_dir).
        logs = {
            rank: open(log_dir / f"rank{rank}.log", "a", encoding="utf-8", errors="surrogateescape", buffering=1)
            for rank in self._tails
        }
        self._sink = OutputSink(self.view, logs, self._tails)
        self._failure: Failure | None = None
        self._failed_at = 0.0  # wall clock: when the first failure came (Note [one cause under srun])
        self._exit_codes: dict[int, int] = {}
        self._running = set(self._tails)
        self.view.start()
        try:
            for channel in self.channels:
                channel.start(self._sink)
            self._supervise()
            if self._phase.state.dumping and self._failure is None:
                self._blame_hang()
        finally:
            leftovers = self._wind_down()
        return self._result(leftovers)

    def _supervise(self) -> None:
        """Until every rank has ended: signals and requests acted on, progress checked twice a
        second, each control event handled in the order it came."""
        next_check = 0.0
        while self._running:
            now = time.monotonic()
            if self._interrupt.is_set() and self._phase.state is Phase.RUNNING:
                self._stop_all()
            if self._checkpoint_signal is not None and self._save.state is not SaveRequest.PASSED_ON:
                self._pass_on_checkpoint_request(self._checkpoint_signal)
            if self._phase.state is Phase.STOPPING and now - self._phase_since > self.grace_s + 8.0:
                return  # hosts that do not answer: _wind_down closes their sessions
            if now >= next_check:
                next_check = now + 0.5
                self._check_progress(now)
            try:
                self._handle(*self.events.get(timeout=0.1))
            except queue.Empty:
                continue

    def _wind_down(self) -> dict[str, str]:
        """The job's end, however it came: every channel finished, the last exits applied, the
        hosts checked (returns the leftovers: _confirm_ended), the view stopped."""
        for channel in self.channels:
            channel.finish()
        self._drain()
        self._move(Phase.ENDED)
        leftovers = self._confirm_ended()
        self._sink.close()
        self._name_slurm_ending()
        self.view.stop(self._failure is not None, interrupted=self._interrupt.is_set())
        return leftovers

    def _result(self, leftovers: dict[str, str]) -> JobResult:
        job_root_cause = getattr(self.view, "job_root_cause", None)
        if job_root_cause is not None:  # one node of several (job_view.JobWideView)
            self._failure = job_root_cause(None if self._failure is None else (self._failed_at, self._failure))
        # A checkpoint signal that was never passed on (the job ended before every rank made a
        # step) saved nothing: the job ended on its own, and says nothing of a save.
        return JobResult(self._failure, self._interrupt.is_set(), self._exit_codes, self.plan.run_dir, leftovers,
                         self._signal if self._interrupt.is_set() else None,
                         self._checkpoint_signal if self._save.state is SaveRequest.PASSED_ON else None)

    # Note [a preemption before the steps]: a preemption with a grace time signals the job's
    # steps, not the batch script; one that comes while the launcher starts, before the agent
    # steps exist, signals nobody, and the job trained through the grace until Slurm's KILL (45
    # steps lost, nothing saved). Once every rank has joined, every agent step exists and gets
    # any later SIGTERM itself; whether one came before is in the job's record (PreemptTime),
    # asked once then. A preemption found there is acted on as an agent's SIGTERM would be:
    # with checkpoint.on_signal a save at the next step, else the job stops and the launcher
    # requeues it with what it had (checkpoint.requeue; cli/run.py).
    def _check_preempted_already(self) -> None:
        asked = self._preempted_already
        if asked is None:
            return
        self._preempted_already = None

        def check() -> None:
            if not asked() or self._agent_term:
                return
            say = getattr(self.view, "on_output", None)
            if say is not None:
                say("launcher", -1, "zerorun: Slurm preempted the job before its steps started (its record says "
                    "so; no step got the SIGTERM): " + ("every rank saves at the next step" if self._is_preemption
                                                         is not None else "stopping the job"))
            if self._is_preemption is not None:
                self.request_checkpoint(signal.SIGTERM)
            else:
                self.interrupt(signal.SIGTERM)

        threading.Thread(target=check, name="zerorun-preempted-already", daemon=True).start()

    def _name_slurm_ending(self) -> None:
        """A job whose workers Slurm killed (scancel, preemption, a node failure) failed only in
        the workers' exits, and one that saved on a signal and stopped did not finish: the
        summary's header says what the closing line will say (outcome.summary_ending)."""
        saved = self._save.state is SaveRequest.PASSED_ON
        stopped = self._failure is not None or self._signal == signal.SIGTERM or saved
        cause = self._slurm_ending() if self._slurm_ending is not None and stopped else None
        checkpointed = saved and self._failure is None and not self._interrupt.is_set()
        word = summary_ending(cause, self._checkpoint_signal if checkpointed else None,
                              in_slurm=self._slurm_ending is not None)
        name_ending = getattr(self.view, "name_ending", None)
        if word is not None and name_ending is not None:
            name_ending(word)

    def _pass_on_checkpoint_request(self, signum: int) -> None:
        """Note [save request waits for training]: a worker installs its SIGUSR1 handler in
        ``zerorun.initialize``; before that SIGUSR1 would kill it (Slurm's timer can fire
        within a second of the job's start). So the request goes to the workers only once every
        rank has reported a step: until then there is nothing to save anyway. A job that never
        reports steps keeps running until Slurm's SIGTERM at the time limit."""
        name = signal_name(signum)
        collector = getattr(self.view, "collector", None)
        if collector is not None:
            steps = {v.rank: v.step for v in collector.snapshot(output_lines=0).ranks}
            if any((steps.get(rank) or 0) < 1 for rank in self._tails):
                if self._save.state is SaveRequest.NONE:
                    self._save.move(SaveRequest.DEFERRED)
                    self._sink.output("launcher", None, f"{name}: the ranks have not all made a step yet; the "
                                      "checkpoint is asked for once they have (checkpoint.on_signal)")
                return
        self._save.move(SaveRequest.PASSED_ON)
        self._sink.output("launcher", None, f"{name}: asking every rank to save a checkpoint at its next step "
                          "and stop (checkpoint.on_signal)")
        for channel in self.channels:
            channel.checkpoint()

    def _handle(self, host: str, event: dict) -> None:
        kind, rank = event.get("t"), event.get("rank")
        if kind == "joined" and rank in self._running:
            self._watch.rank_started(rank, time.monotonic())  # Note [start-up is not a hang]
            self._joined.add(rank)
            if self._joined == set(self._tails):
                self._check_preempted_already()
        elif kind == "exit" and rank in self._running:
            rc = int(event["rc"])
            self._running.discard(rank)
            self._watch.rank_started(rank, time.monotonic())  # an ended rank is not starting
            self._exit_codes[rank] = rc
            self.view.on_worker_exit(host, rank, rc)
            if rc != 0 and not self._phase.state.dumping and self._failure is None:
                # Only the first failure is the root cause: ranks that die after we began
                # stopping are its consequences (or our own TERM) -- unless the first one's own
                # error names another rank as the cause (Note [the cause a failure names]).
                self._fail(self._exit_failure(rank, rc))
        elif kind == "signal" and event.get("sig") == signal.SIGTERM:
            # An agent step got Slurm's SIGTERM (the batch script may get none: a preemption
            # with a grace time signals the steps). Without on_signal its workers die of it and
            # the closing line names the cause (cli/run.py slurm_ended).
            self._agent_term = True
            if self._is_preemption is not None:
                self.judge_term(signal.SIGTERM)
        elif kind == "gone":
            self._on_gone(host, event)

    def _on_gone(self, host: str, event: dict) -> None:
        """``host``'s agent is gone: its ranks still running are lost, and that is a failure."""
        lost = {r for r in self._running if self._host_of[r] == host}
        if lost:
            self._lost_hosts.add(host)
            channel = next(c for c in self.channels if c.host == host)
            if channel.local:
                reason = f"its agent process died ({describe_exit(event.get('rc') or 0)})"
            else:
                detail = "; ".join(event.get("stderr", [])[-3:]) or f"{channel.reach} exit code {event.get('rc')}"
                what = "Slurm step running" if channel.reach == "srun" else "ssh session to"
                reason = f"lost the {what} its agent ({detail})"
            self._fail(Failure(host, None, reason))
        self._running -= lost

    def _fail(self, failure: Failure) -> None:
        if self._failure is None and self._phase.state is not Phase.STOPPING:
            self._failure = failure
            self._failed_at = time.time()
            self._stop_all()

    def _drain(self) -> None:
        """Apply the exits that arrived after the loop ended (their logs are already written),
        then settle the root cause on the complete logs (Note [the cause a failure names])."""
        while True:
            try:
                host, event = self.events.get_nowait()
            except queue.Empty:
                break
            if event.get("t") == "exit":
                self._handle(host, event)
        self._settle_cause()

    def _exit_failure(self, rank: int, rc: int, reason: str | None = None) -> Failure:
        """A rank's non-zero exit as a failure, with its log as it stands now."""
        tail = list(self._tails[rank])
        stated = watchdog.job_cause_stated(tail)  # the closing line then names it
        reason = reason or describe_exit(rc)
        return Failure(self._host_of[rank], rank, reason + (f": {stated}" if stated else ""), rc, tail)

    # Note [the cause a failure names]: a rank that fails because another did says so in its
    # own last line ("rank 0 (pid N) exited while this rank waited for it in a collective", "...
    # failed on rank 0 (its error says why)"; watchdog.cause_named). Which of the two exits
    # reaches the launcher first is a race, and the blaming rank's last lines can even arrive
    # after its exit (the agent waits for them only a second): deciding on arrival named rank 1
    # in the closing block while rank 1's own line blamed rank 0, in 1 of 2 runs. So the cause
    # is settled once, after every channel has finished (every exit and line is in): from the
    # first failure, follow the rank each failure's complete log names, while that rank failed
    # too -- even when it was our own stop that ended it, as it was still exiting after its
    # error. Ranks of other nodes are job_cause.py's (Note [one cause under srun]).
    def _settle_cause(self) -> None:
        failure = self._failure
        if failure is None or failure.rank is None or failure.returncode is None:
            return  # not a rank's exit (a lost host, a hang, a script that left mid-collective)
        first = rank = failure.rank
        seen = {rank}
        while True:
            named = watchdog.cause_named(list(self._tails[rank]))
            if named is None or named in seen or self._exit_codes.get(named, 0) == 0:
                break
            rank = named
            seen.add(rank)
        rc = self._exit_codes[rank]
        reason = None
        if rank != first and rc in STOP_CODES:
            reason = (f"rank {first}'s error names it as the cause; it was still exiting when the launcher "
                      f"stopped it ({describe_exit(rc)})")
        self._failure = self._exit_failure(rank, rc, reason)

    def _move(self, phase: Phase) -> None:
        """Note [supervision states]: an illegal move is an InternalError."""
        self._phase.move(phase)
        self._phase_since = time.monotonic()

    def _stop_all(self) -> None:
        self._move(Phase.STOPPING)
        for channel in self.channels:
            channel.stop()

    # --- hangs (Note [hang timeout] in watchdog.py) -----------------------------------------
    def _check_progress(self, now: float) -> None:
        if self._phase.state is Phase.STOPPING:
            return
        if self._phase.state.dumping:
            # Stacks asked for: every worker ends on SIGABRT; give a stuck one a few seconds.
            if now - self._phase_since > 3.0:
                self._blame_hang()
            return
        self._watch.progress(self._sink.last_output)
        if self._observe_ranks(now):
            return
        if self._watch.startup_expired(now):
            self._starting_at_dump = sorted(self._watch.starting)
            starting = ", ".join(map(str, self._starting_at_dump))
            self._sink.output("launcher", None, f"START-UP: rank(s) {starting} still starting after "
                              f"{self._watch.startup_timeout_s:g} s (--startup-timeout); collecting every rank's "
                              "Python stack and ending the job")
            self._begin_dump(Phase.DUMPING_STARTUP)
            return
        idle = self._watch.idle_s(now)
        if self._warned_at is not None and self._watch.last_progress > self._warned_at:
            self._warned_at = None  # progress resumed: a later quiet spell is warned about again
        if 0 < self._hang_warn_s <= idle and self._warned_at is None and not self._watch.expired(now):
            self._warned_at = now
            ends = (f"; the job is ended after {self._watch.timeout_s:.0f} s (--hang-timeout)"
                    if self._watch.timeout_s > 0 else "")
            self._sink.output("launcher", None, f"HANG? no rank has made progress for {self._hang_warn_s:g} s{ends}")
        if self._watch.expired(now):
            self._sink.output("launcher", None, f"HANG: no rank has made progress for {self._watch.timeout_s:g} s "
                              "(--hang-timeout); collecting every rank's Python stack and ending the job")
            self._hang_missing = self._collective_missing()
            self._begin_dump(Phase.DUMPING_HANG)

    def _observe_ranks(self, now: float) -> bool:
        """What the view's collector shows of each rank, into the progress watch; True when a rank
        left while others wait for it in a collective (the job is failing: _left_mid_collective)."""
        collector = getattr(self.view, "collector", None)
        if collector is None:
            return False
        ranks = collector.snapshot(output_lines=0).ranks
        for view in ranks:
            # A sample alone says the worker runs, not that it joined the rendezvous (its
            # recorder starts with the interpreter: Note [any script is visible]).
            if view.step is not None or (view.entered_seq or -1) >= 0 or view.comm:
                self._watch.rank_started(view.rank, now)
        # A checkpoint being written moves ``activity`` (bytes so far): progress too.
        self._watch.observe({v.rank: (v.step, v.entered_seq, sum(c.count for c in v.comm), v.activity)
                             for v in ranks}, now)
        running = [v for v in ranks if v.rank in self._running]
        self._watch.exiting = bool(running) and all(v.activity and v.activity[0] == "leaving" for v in running)
        return self._left_mid_collective(ranks)

    def _left_mid_collective(self, ranks) -> bool:
        """Note [failing exits] in comm/process_group.py: a rank whose script ended (activity
        "leaving") while others wait for it in a zerorun collective it never entered is the
        cause; the job ends now instead of after its 30 s exit barrier (or a hang timeout)."""
        leaving = {v.rank for v in ranks if v.activity and v.activity[0] == "leaving" and v.rank in self._running}
        if not leaving:
            return False
        from zerorun.telemetry.collector import detect_hang

        hang = detect_hang(list(ranks), 0.0)
        culprits = sorted(leaving & set(hang.missing)) if hang is not None else []
        if not culprits:
            return False
        rank = culprits[0]
        waiting = ", ".join(map(str, hang.waiting)) if hang is not None else ""
        self._fail(Failure(self._host_of[rank], rank, f"its script ended (raise SystemExit, or the end of the script) "
                           f"while rank(s) {waiting} wait for it in a collective it never entered",
                           log_tail=list(self._tails[rank])))
        return True

    def _begin_dump(self, phase: Phase) -> None:
        self._move(phase)
        for channel in self.channels:
            channel.dump_stacks()

    def _collective_missing(self) -> tuple[int, ...]:
        """Ranks that have not entered the zerorun collective others are blocked in, if any."""
        collector = getattr(self.view, "collector", None)
        if collector is None:
            return ()
        from zerorun.telemetry.collector import detect_hang

        hang = detect_hang(list(collector.snapshot(output_lines=0).ranks), 0.0)
        return hang.missing if hang is not None else ()

    def _blame_hang(self) -> None:
        stacks = {
            rank: watchdog.main_stack(watchdog.parse_fault_stacks(list(tail))) for rank, tail in self._tails.items()
        }
        stacks = {rank: stack for rank, stack in stacks.items() if stack}
        timeout = self._watch.timeout_s
        if self._phase.state is Phase.DUMPING_STARTUP:
            starting = self._starting_at_dump
            names = "rank " + str(starting[0]) if len(starting) == 1 else "ranks " + ", ".join(map(str, starting))
            reason = (f"still starting after {self._watch.startup_timeout_s:g} s (--startup-timeout): {names} "
                      f"had not joined the rendezvous (torch.distributed.init_process_group)")
            hosts = sorted({self._host_of[rank] for rank in starting})
            failure = Failure(", ".join(hosts), starting[0] if len(starting) == 1 else None, reason, stacks=stacks)
            self._fail(failure)
            return
        culprits = watchdog.blame(stacks, self._hang_missing, ranks=tuple(self._host_of))
        if culprits:
            others = sorted(set(stacks) - set(culprits))
            waiting = ""
            if others:
                names = "rank " + str(others[0]) if len(others) == 1 else "ranks " + ", ".join(map(str, others))
                waiting = f"; {names} {'waits' if len(others) == 1 else 'wait'} for it in a collective"
            rank = culprits[0]
            reason = (f"hung: no rank made progress for {timeout:g} s and this rank is the one the others "
                      f"wait for{waiting}")
            if len(culprits) > 1:
                reason += f"; so are ranks {', '.join(map(str, culprits[1:]))}"
            if rank not in stacks:
                reason += ("; it printed no Python stack when asked (a stopped process, SIGSTOP or Ctrl-Z, "
                           "cannot; nor can one stuck outside Python)")
            failure = Failure(self._host_of[rank], rank, reason, stacks=stacks)
        else:
            hosts = sorted(set(self._host_of.values()))
            reason = (f"hung: no rank made progress for {timeout:g} s; the stacks do not tell which rank the "
                      "others wait for")
            failure = Failure(hosts[0] if len(hosts) == 1 else ", ".join(hosts), None, reason, stacks=stacks)
        self._fail(failure)

    # --- teardown check (Note [workers die with their agent] in agent.py) ---------------------
    def _confirm_ended(self) -> dict[str, str]:
        """Host -> problem, for hosts where processes of the run may be left.

        This host is always swept (cheap, and it also catches a process that left its group).
        A remote host is checked over ssh only when its agent did not end cleanly.
        """
        leftovers = {}
        for channel in self.channels:
            clean = channel.done and not channel.killed and channel.host not in self._lost_hosts
            if clean and not channel.local:
                continue
            problem = channel.sweep(self.token, wait_s=0.0 if clean else 3.0)
            if problem:
                leftovers[channel.host] = problem
        return leftovers
