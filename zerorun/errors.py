"""One error tree for zerorun.

Every error a user can cause is a ``ZerorunError``: the CLI prints it as a single line
(``error: <message>`` and, when present, ``hint: <hint>``) and exits non-zero, without a
traceback. Set ``ZERORUN_DEBUG=1`` to see the traceback of zerorun itself.
"""

from __future__ import annotations


class ZerorunError(Exception):
    """Base of every error a user can cause. ``exit_code`` is what the CLI exits with."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class ConfigError(ZerorunError):
    """A config file or dict is unreadable, has unknown keys, wrong types or impossible values."""


class HostfileError(ZerorunError):
    """A hostfile or an --include/--exclude filter is malformed (the message names the line/token)."""


class LaunchError(ZerorunError):
    """The job cannot start: missing script, GPUs that are not there, unreachable hosts."""


class JobFailed(ZerorunError):
    """A worker failed; the message names the root cause (host, rank, exit code or signal)."""

    exit_code = 1


class PlannerError(ZerorunError):
    """``zerorun estimate`` got a model or job it cannot plan."""


class RuntimeConfigError(ZerorunError):
    """The engine was given a model/optimizer/config combination it cannot run."""


class RendezvousError(ZerorunError):
    """Something outside the job spoke to its rendezvous, or the rendezvous could not be set up
    (Note [authenticated rendezvous] in zerorun/zero/comm/rendezvous.py)."""


class CheckpointError(ZerorunError):
    """A checkpoint cannot be written or read: missing, damaged (the message names the file),
    from an incompatible model (it names the first mismatching parameter), or a bad tag."""


class StorageError(ZerorunError):
    """Scratch or checkpoint storage failed under a running job: a short read or write, an I/O
    error, a file removed or truncated. The message names the rank, the file and the byte counts."""

    exit_code = 1


class UnsupportedFeature(ZerorunError):
    """A DeepSpeed name (pipeline parallelism, MoE, tensor or sequence parallelism, compression)
    that has no meaning in zerorun; raised when it is first used, naming the feature."""


class UsageError(ZerorunError):
    """An engine method was called with an argument or at a moment its contract does not allow."""


class InternalError(ZerorunError):
    """A state machine of zerorun reached a transition it forbids: a bug in zerorun, not in the
    user's script. Raised explicitly (an ``assert`` would vanish under ``python -O``)."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message, hint or "this is a zerorun bug: rerun with ZERORUN_DEBUG=1 and report the traceback")
