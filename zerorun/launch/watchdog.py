"""Hang handling (pure): is the job still making progress, whose stack shows it is the one stuck.

Note [hang timeout]: zerorun's own collectives tell the dashboard which rank a collective is
waiting for, but a rank can just as well hang in the script's own ``dist.all_reduce``, where
zerorun sees no collective at all. The watchdog therefore asks only whether *anything* moves:
a line of output from any rank, a new step, a collective entered or finished, a checkpoint
being written. When nothing has moved for ``--hang-timeout`` seconds, the launcher has every
worker print its Python stacks (faulthandler, on SIGABRT) and ends the job. The stacks name
the cause: ranks waiting for the others sit inside a collective (torch.distributed or
zerorun.zero.comm); the rank that is elsewhere is the one they wait for.

Note [exiting is not a hang]: once every running rank has ended its script (its recorder says
"leaving", then "bye"), what is left is the exit barrier and the interpreter's teardown: the
process group, threads, modules. Nothing reports progress there, and on a loaded machine it takes
seconds (a 4 s --hang-timeout ended a job that had saved and finished). Such a job is judged
hung only after ``EXIT_ALLOWANCE_S`` (the exit barrier's own limit) or the hang timeout,
whichever is longer; a rank still training is judged as before.

Note [start-up is not a hang]: importing torch from a slow shared file system, reading a data
set or compiling can keep a rank silent for minutes before it does anything collective, and a
silent rank there is slow, not stuck. So the hang clock runs only once *every* rank has started:
joined the rendezvous (its agent sees a TCP connection to, or the listening socket on,
MASTER_PORT: what ``init_process_group`` opens), or reported a step or a collective. Until then
only the start-up limit applies (``--startup-timeout``, off by default), and its report says
which ranks were still starting, with their stacks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


def _package_path(package: str) -> str:
    """``zerorun/zero/comm/`` for ``zerorun.zero.comm``: derived from where the package is, so a
    moved module cannot leave the watchdog looking in the wrong place (nothing is imported)."""
    import zerorun

    root = Path(zerorun.__file__).resolve().parent.parent
    path = root.joinpath(*package.split("."))
    return path.relative_to(root).as_posix() + "/"


# Frames in these files mean "waiting in a collective" (or in the rendezvous, which is one).
COLLECTIVE_FILES = ("torch/distributed/", _package_path("zerorun.zero.comm"))
# Frames in these files are machinery; the first frame outside them is "the line it is stuck on".
LIBRARY_FILES = ("<frozen", "/site-packages/", "/dist-packages/", "/lib/python3",
                 _package_path("zerorun.zero"), _package_path("zerorun.telemetry"))
# A frame of the import system: the rank is importing modules (torch.distributed's own module
# bodies included), which is start-up, never "waiting in a collective".
IMPORT_FRAMES = ("<frozen importlib._bootstrap",)

_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')


EXIT_ALLOWANCE_S = 30.0  # Note [exiting is not a hang]: the exit barrier's limit (comm/process_group.py)


class ProgressWatch:
    """When did anything last move? ``timeout_s`` 0 means never time out.

    ``ranks``: the ranks still starting (Note [start-up is not a hang]); the hang clock starts
    when the last of them has started. ``startup_timeout_s`` (0 = never) bounds start-up.
    """

    def __init__(self, timeout_s: float, now: float, *, ranks: tuple[int, ...] = (),
                 startup_timeout_s: float = 0.0):
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.launched_at = now
        self.last_progress = now
        self.starting = set(ranks)
        self._marks: dict = {}
        # Every running rank has ended its script (Note [exiting is not a hang]).
        self.exiting = False

    def rank_started(self, rank: int, now: float) -> None:
        if rank in self.starting:
            self.starting.discard(rank)
            if not self.starting:
                self.last_progress = max(self.last_progress, now)  # the hang clock starts now

    def progress(self, now: float) -> None:
        self.last_progress = max(self.last_progress, now)

    def observe(self, marks: dict, now: float) -> None:
        """``marks``: per rank, anything that changes when the rank moves (step, collective seq)."""
        if marks != self._marks:
            self._marks = dict(marks)
            self.progress(now)

    def idle_s(self, now: float) -> float:
        """Seconds without progress; 0 while some rank is still starting (not a hang)."""
        return 0.0 if self.starting else now - self.last_progress

    def expired(self, now: float) -> bool:
        limit = max(self.timeout_s, EXIT_ALLOWANCE_S) if self.exiting else self.timeout_s
        return self.timeout_s > 0 and not self.starting and self.idle_s(now) >= limit

    def startup_expired(self, now: float) -> bool:
        return self.startup_timeout_s > 0 and bool(self.starting) and now - self.launched_at >= self.startup_timeout_s


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.func}"


def parse_fault_stacks(lines: list[str]) -> list[list[Frame]]:
    """The threads of the last faulthandler dump in ``lines``, each innermost frame first."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error:")]
    if not starts:
        return []
    threads: list[list[Frame]] = []
    current: list[Frame] | None = None
    for line in lines[starts[-1]:]:
        if _THREAD.match(line.strip()):
            current = []
            threads.append(current)
            continue
        match = _FRAME.match(line)
        if match and current is not None:
            current.append(Frame(match["file"], int(match["line"]), match["func"]))
        elif line.strip() and current is not None:
            current = None  # "Extension modules: ..." or the next output: the dump has ended
    return [thread for thread in threads if thread]


def main_stack(threads: list[list[Frame]]) -> list[Frame]:
    """The main thread's stack: the one whose outermost frame is a module's top level."""
    for thread in threads:
        if thread[-1].func == "<module>":
            return thread
    return threads[0] if threads else []


def activity(stack: list[Frame]) -> str:
    """What the stack shows the rank doing: "collective", "importing" or "elsewhere".

    The innermost telling frame decides: an import-system frame (even one running
    torch.distributed's module body) is start-up; a call into a collective module is waiting.
    """
    for frame in stack:
        if frame.file.startswith(IMPORT_FRAMES):
            return "importing"
        if frame.func != "<module>" and any(part in frame.file for part in COLLECTIVE_FILES):
            return "collective"
    return "elsewhere"


def in_collective(stack: list[Frame]) -> bool:
    return activity(stack) == "collective"


def describe_activity(stack: list[Frame]) -> str:
    return {"collective": "waiting in a collective", "importing": "importing modules",
            "elsewhere": "not in a collective"}[activity(stack)]


def stuck_at(stack: list[Frame]) -> Frame | None:
    """The innermost frame of the user's own code (else the innermost frame)."""
    for frame in stack:
        if not any(part in frame.file for part in LIBRARY_FILES):
            return frame
    return stack[0] if stack else None


def blame(stacks: dict[int, list[Frame]], missing: tuple[int, ...] = (), ranks: tuple[int, ...] = ()) -> list[int]:
    """The ranks the others wait for.

    ``missing``: ranks zerorun's collectives know have not entered the collective the others
    wait in (the most precise answer, when there is one). Otherwise the ranks whose stack is
    not inside a collective while some other rank's is; failing that, when every stack shown is
    inside a collective, the ranks of ``ranks`` that showed none (a SIGSTOPped process cannot
    print its stack). Empty when nothing tells them apart.
    """
    if missing:
        return sorted(missing)
    waiting = {rank for rank, stack in stacks.items() if stack and in_collective(stack)}
    elsewhere = sorted(rank for rank, stack in stacks.items() if stack and rank not in waiting)
    if waiting and elsewhere:
        return elsewhere
    silent = sorted(rank for rank in ranks if not stacks.get(rank))
    return silent if waiting and silent else []


# zerorun's own lines that blame another rank: a checkpoint or set-up step that failed "on rank
# N" elsewhere, and the host channel's peer that exited.
_NAMES_CAUSE = (re.compile(r"zerorun: error: rank \d+: .* failed on rank (\d+) \(its error says why\)"),
                re.compile(r"zerorun: error: rank (\d+) \(pid \d+\) (?:exited|closed its inbox)"))


# A worker's own error that is the job's cause in itself, whichever rank printed it first: the
# ranks' collectives disagreed (Note [collective agreement] in zerorun/zero/comm/agreement.py).
_JOB_CAUSE = re.compile(r"zerorun: error: (collective mismatch, .*)")


def job_cause_stated(lines: list[str]) -> str | None:
    """The job-wide cause a worker's last lines state (a collective mismatch), or None."""
    for line in reversed(lines[-20:]):
        found = _JOB_CAUSE.search(line)
        if found:
            return found.group(1).rstrip()
    return None


def cause_named(lines: list[str]) -> int | None:
    """The rank a worker's last lines name as the cause of its own failure, or None."""
    for line in reversed(lines[-20:]):
        for pattern in _NAMES_CAUSE:
            found = pattern.search(line)
            if found:
                return int(found.group(1))
    return None

