"""Which process group the engine talks over, decided once in ``initialize``.

Order (as the issue states): the default group if the caller initialised one; else one
initialised from the launcher's / torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT); else, under plain ``srun python train.py``, one rank per Slurm task
(SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, the first node of SLURM_STEP_NODELIST and
the port of Note [Slurm port] in worker/slurm_env.py); else world size 1 with no torch.distributed
at all. Where Slurm says there are several tasks but no world can be formed, the error says
so: never a silent world of 1.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerorun.errors import RuntimeConfigError
from zerorun.worker import device
from zerorun.zero.comm import rendezvous
from zerorun.zero.comm.host_channel import close_host_channels
from zerorun.zero.comm.ring_driver import close_ring_drivers


@dataclass(frozen=True)
class ProcessGroupInfo:
    group: object  # None = the default group (or no group at all when world_size == 1)
    rank: int
    world_size: int
    device: torch.device


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise RuntimeConfigError(f"environment variable {name}={value!r} is not an integer") from None


def resolve_process_group(model_device: torch.device | None = None) -> ProcessGroupInfo:
    """Join (or create) the group, on this worker's device (Note [device contract] in
    zerorun/worker/device.py): NCCL if and only if that device is a GPU, made current first,
    also when the script started the group itself (``all_gather_object`` and allocations
    without a device use the current GPU, cuda:0 on every rank otherwise). ``model_device``
    (where the model was built) matters only beside a gloo group the script started."""
    if dist.is_available() and dist.is_initialized():
        choice = device.this_worker(built_on=None if model_device is None else str(model_device))
        device.bind(choice)
        leave_at_exit()  # a group the script (Trainer, Accelerate) started aborts at exit the same way
        return ProcessGroupInfo(None, dist.get_rank(), dist.get_world_size(), choice.torch_device())
    if _env_int("WORLD_SIZE") is None and _env_int("RANK") is None:
        adopt_slurm_step(os.environ)  # before the device: it writes LOCAL_RANK
    from zerorun.worker import save_on_signal

    save_on_signal.arm()  # checkpoint.on_signal: SIGUSR1 only noted, never fatal (save_on_signal.py)
    choice = device.this_worker()
    device.bind(choice)
    world_size = _env_int("WORLD_SIZE") or 1
    if world_size == 1:
        return ProcessGroupInfo(None, 0, 1, choice.torch_device())
    rank = _env_int("RANK")
    if rank is None:
        raise RuntimeConfigError("WORLD_SIZE is set but RANK is not; start workers with zerorun or torchrun")
    for needed in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(needed):
            raise RuntimeConfigError(f"WORLD_SIZE={world_size} but {needed} is not set")
    secret = rendezvous.secret_for(os.environ)
    if secret is None:  # torchrun, srun python: torch's own rendezvous
        dist.init_process_group(choice.backend, init_method="env://", rank=rank, world_size=world_size)
    else:  # started by zerorun: Note [authenticated rendezvous]
        rendezvous.init_signed(choice.backend, rank, world_size, secret)
    leave_at_exit()
    return ProcessGroupInfo(None, rank, world_size, choice.torch_device())


def adopt_slurm_step(environ) -> None:
    """Under ``srun python train.py``: write the Slurm step's world as torchrun's variables.

    Written into the environment (not only used here) so that ``env://`` initialisation and the
    script's own reads of RANK/LOCAL_RANK agree with the group formed.
    """
    from zerorun.errors import ZerorunError
    from zerorun.worker.slurm_env import step_world

    try:
        world = step_world(environ)
    except ZerorunError as err:
        raise RuntimeConfigError(err.message, hint=err.hint) from None
    if world is None:
        return
    environ.update({
        "RANK": str(world.rank), "WORLD_SIZE": str(world.world_size), "LOCAL_RANK": str(world.local_rank),
        "MASTER_ADDR": world.master_addr, "MASTER_PORT": str(world.master_port),
    })


# Note [settled before teardown]: a collective can be left in flight past the call that issued
# it (stages 1-2's refresh, Note [refresh on first read] in zero/refresh_ahead.py, runs into the
# next forward), and a script ends with ``dist.destroy_process_group()`` right after its last
# step, often after a ``dist.barrier()`` of its own. Destroying the group then aborted every run
# of scripts/bench_link.py at stage 1 ("terminate called without an active exception"): the
# refresh's last pieces had just been waited, and gloo's threads still held their work objects
# when the interpreter shut down (Note [clean exit]). So whoever leaves work in flight registers
# how to finish it (``settle_before_teardown``), ``leave_together`` finishes it first, and once
# zerorun has a group torch's ``destroy_process_group`` of the default group is
# ``leave_together`` (bounded by EXIT_BARRIER_TIMEOUT_S, as at exit; DeepSpeed's
# ``deepspeed.comm.destroy_process_group`` is that already, zerorun/deepspeed/comm.py). A destroy
# while an exception is in flight (a ``finally``), or after an uncaught one, destroys at once:
# a peer may be gone, and waiting for it would only delay the launcher's report.
_IN_FLIGHT: weakref.WeakSet = weakref.WeakSet()
_destroy_now = dist.destroy_process_group  # torch's own, unwrapped


def settle_before_teardown(owner) -> None:
    """``owner.settle()`` finishes what ``owner`` left in flight; called before the group goes."""
    _IN_FLIGHT.add(owner)


def finish_before_destroy() -> None:
    """Note [settled before teardown]: wrap ``torch.distributed.destroy_process_group`` once
    (``leave_at_exit``: the first group zerorun joins or starts)."""
    if getattr(dist.destroy_process_group, "_zerorun_settles", False):
        return

    @functools.wraps(_destroy_now)
    def destroy_process_group(group=None):
        default = group is None or group is dist.GroupMember.WORLD
        failing = sys.exc_info()[0] is not None or _uncaught_exception or _failing_exit
        if not default or failing or not (dist.is_available() and dist.is_initialized()):
            return _destroy_now(group)
        if not _leave_within(EXIT_BARRIER_TIMEOUT_S) and dist.is_initialized():
            _destroy_now()

    destroy_process_group._zerorun_settles = True  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group


def leave_together(group=None, *, settle_timeout_s: float = 5.0, gpu: int | None = None) -> None:
    """Meet every rank at a barrier, let gloo's threads drop their last work, destroy the group.

    Note [clean exit]: a rank can abort at interpreter shutdown after a clean run (SIGABRT,
    "terminate called without an active exception"). Caught in gdb: gloo runs collectives on
    its own threads ("pt_gloo_runloop"), and a thread drops its reference to a finished work
    object only *after* the waiting Python thread has been woken. Dropping it releases the
    work's tensors, which needs the GIL; if the main thread is already finalizing the
    interpreter by then, the gloo thread is force-exited inside a noexcept destructor and the
    C++ runtime calls terminate. A barrier and destroy_process_group() do not prevent it (the
    destroyed group's threads live on). Under load it hit a fifth to a third of the runs of a
    2-rank test script on the 2-core VM (2 of 12, 3 of 16, 5 of 15).

    So after the barrier, GLOO_THREADS probe all-reduces run one after another, and after
    each this thread sleeps (releasing the GIL) until the probe tensor's Python reference
    count is back to its value before the collective: that happens exactly when the gloo
    thread that ran the probe has dropped the work, and a gloo thread drops its current work
    before it takes the next. Every earlier work had finished (the barrier), and the sleeps
    hand the GIL to any gloo thread still dropping one. With it, 0 of 45 runs of that script
    under the same load aborted.

    ``gpu``: this rank's GPU, named to an NCCL barrier (Note [exit barrier device]).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    for owner in list(_IN_FLIGHT):  # Note [settled before teardown]
        owner.settle()
    if gpu is not None and dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=[gpu])
    else:
        dist.barrier(group=group)
    close_host_channels()  # every rank has issued its last collective (the barrier): finish and stop
    close_ring_drivers()
    if dist.get_backend(group) == "gloo":
        probe = torch.zeros(1)
        unreferenced = sys.getrefcount(probe)
        deadline = time.monotonic() + settle_timeout_s
        for _ in range(GLOO_THREADS):
            dist.all_reduce(probe, group=group)
            while sys.getrefcount(probe) > unreferenced and time.monotonic() < deadline:
                time.sleep(0.001)
    _destroy_now(group)


@contextlib.contextmanager
def leaving_together(group=None):
    """``with leaving_together(): ...`` around a worker's body: ``leave_together`` when the body
    finishes; when it raises, a plain destroy, with no barrier that failed peers never reach."""
    try:
        yield
    except BaseException:
        close_host_channels(finished=False)
        close_ring_drivers(finished=False)
        if dist.is_available() and dist.is_initialized():
            _destroy_now()  # nothing in flight is waited for: a peer may be gone
        raise
    leave_together(group)


# ProcessGroupGloo's default number of worker threads (its Options.threads); leave_together
# probes once per thread.
GLOO_THREADS = 2


def leave_at_exit() -> None:
    """Once per process: ``leave_process_group`` at exit (Note [clean exit]), and the watch that
    keeps a rank dying of an exception from waiting there for peers."""
    global _leaving_at_exit
    if _leaving_at_exit:
        return
    _leaving_at_exit = True
    atexit.register(leave_process_group)
    finish_before_destroy()
    _watch_for_uncaught_exceptions()


def leave_process_group() -> None:
    """At exit: ``leave_together`` on the group zerorun created (Note [clean exit]).

    Only on a clean exit: a rank dying of an uncaught exception, or leaving with a failing
    status (``raise SystemExit("...")``, ``sys.exit(1)``: Note [failing exits]), must exit at
    once, so the launcher sees it and ends the job in seconds, rather than wait at a barrier
    its peers never reach (it used to hold the job for EXIT_BARRIER_TIMEOUT_S, and the
    dashboard called the quiet a hang). A clean exit waits at most ``EXIT_BARRIER_TIMEOUT_S``.
    """
    if _uncaught_exception or _failing_exit or not (dist.is_available() and dist.is_initialized()):
        return
    # Note [failing exits]: say so, in case a peer waits for this rank in a collective it never
    # entered (a bare ``raise SystemExit(...)`` mid-job): the launcher then ends the job now.
    from zerorun.telemetry import get_recorder

    recorder = get_recorder()
    recorder.record_activity("leaving", 0)
    recorder.send_sample()  # now: the recorder's own exit handler (it ran first) sent its last one
    _leave_within(EXIT_BARRIER_TIMEOUT_S)


def _leave_within(timeout_s: float) -> bool:
    """``leave_together`` on a thread of its own, waited at most ``timeout_s``: whether it ended."""
    met = threading.Event()
    gpu = exit_gpu()

    def meet() -> None:
        try:
            if gpu is not None:
                torch.cuda.set_device(gpu)  # Note [exit barrier device]
            leave_together(gpu=gpu)
            met.set()
        except Exception:  # a peer already failed: the launcher reports that one, not this
            pass

    threading.Thread(target=meet, name="zerorun-exit-barrier", daemon=True).start()
    return met.wait(timeout_s)


def exit_gpu() -> int | None:
    """The GPU the exit barrier must run on: the calling (main) thread's current one, which
    ``resolve_process_group`` bound to this worker's; None where CUDA was never initialised.

    Note [exit barrier device]: the barrier runs on a thread of its own (so a missing peer
    costs at most EXIT_BARRIER_TIMEOUT_S), and CUDA's current device is per thread: a new
    thread starts on GPU 0. Torch's barrier allocates its tensor on the current device, so
    every rank of a node made a context on GPU 0 at exit (in exclusive compute mode the second
    waited the whole timeout). The thread is therefore bound to the main thread's GPU, and an
    NCCL barrier is told that GPU by ``device_ids``."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


EXIT_BARRIER_TIMEOUT_S = 30.0
_leaving_at_exit = False
_uncaught_exception = False
_watching = False
_failing_exit = False


def _failing(code) -> bool:
    """Whether SystemExit(code) ends the process with a non-zero status (a message is status 1)."""
    return code is not None and code != 0


def _note_exit_status() -> None:
    """Note [failing exits]: an atexit handler cannot see the status the process exits with,
    and SystemExit never reaches sys.excepthook. ``sys.exit`` (what argparse, typer and most
    scripts call) is therefore wrapped to note its status; it raises the same SystemExit. A
    bare ``raise SystemExit(...)`` is not seen here: the rank then announces that it is leaving
    (telemetry activity "leaving"), and the launcher ends the job at once when a peer waits for
    it in a collective it never entered (launch/supervisor.py)."""
    real_exit = sys.exit
    if getattr(real_exit, "zerorun_noting", False):
        return

    def exit(status=None):
        global _failing_exit
        _failing_exit = _failing(status)
        real_exit(status)

    exit.zerorun_noting = True  # type: ignore[attr-defined]
    sys.exit = exit


def _watch_for_uncaught_exceptions() -> None:
    """Chain onto sys.excepthook so leave_process_group knows the script died of an exception.

    A zerorun error (a damaged NVMe file, a checkpoint that cannot load) ends the rank with its
    one line and hint, as the CLI prints them, instead of a traceback of zerorun's internals;
    ZERORUN_DEBUG=1 keeps the traceback. Installed once per process: by the process group's
    creation, and by a refusal raised before it (zerorun.deepspeed's unsupported names)."""
    global _watching
    if _watching:
        return
    _watching = True
    _note_exit_status()
    previous = sys.excepthook

    def note(kind, value, traceback) -> None:
        global _uncaught_exception
        _uncaught_exception = True
        from zerorun.errors import ZerorunError

        if isinstance(value, ZerorunError) and not os.environ.get("ZERORUN_DEBUG"):
            print(f"zerorun: error: {value.message}", file=sys.stderr, flush=True)
            if value.hint:
                print(f"zerorun: hint: {value.hint}", file=sys.stderr, flush=True)
            return
        previous(kind, value, traceback)

    sys.excepthook = note


def partition_groups(world_size: int, size: int, rank: int):
    """ZeRO++ hpZ's subgroups (Note [secondary copy] in zero/unit/secondary.py): the group of
    ``size`` consecutive ranks this rank is in (one host), and the group of the ranks at its
    place in every such group (one per host; None when there is one host). Every rank creates
    every group, in the same order, as ``dist.new_group`` requires."""
    from zerorun.zero.unit.secondary import partition_groups as members

    within, across = members(world_size, size)
    mine_within = mine_across = None
    for ranks in within:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine_within = group
    if len(within) > 1:
        for ranks in across:
            group = dist.new_group(list(ranks))
            if rank in ranks:
                mine_across = group
    return mine_within, mine_across
