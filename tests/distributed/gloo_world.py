"""Imported by tests/distributed/* and tests/integrations/hf_world.py: start small gloo worlds
quickly, and run a body on every rank of one and collect what each returned.

Note [one world helper]: ``run_ranks(body, world, tmp, *args)`` runs ``body(rank, *args)`` on
``world`` forked ranks that have joined one gloo group (a ``file://`` init method under ``tmp``:
no ports to race for), inside ``leaving_together`` (Note [clean exit] in
zerorun/zero/comm/process_group.py) unless told not to, and returns ``{rank: value}``. The value
travels as JSON, so a test sees what the hand-written per-rank files used to hold (tuples as
lists, dict keys as strings), and its assertions read the same. A body that raises fails its rank
and so the test (torch's ProcessRaisedException names it); a body that reports an error as its
value instead, after which the world is broken, ends its rank with ``end_rank_now(value)``. The older ``spawn_and_collect`` leaves
joining and writing ``out_dir/rank{R}.json`` to its worker, ``worker(rank, rendezvous_file, out_dir)``.

Note [forked ranks]: a rank started with multiprocessing's "spawn" is a fresh interpreter that
imports torch and zerorun again, 2-3 s of CPU per rank; the default run starts some 40 worlds,
so that import was the largest single cost of tests/distributed. ``start_processes`` starts
ranks with "forkserver" instead: one server process per pytest run imports ``PRELOAD`` once and
forks each rank from that, so a rank starts in a tenth of a second (what it imports beyond
that, transformers for one, it imports itself, as before). What a rank sees is what a
spawned one saw: the server has only imported modules (no test ran in it, no thread pool or
process group was started, no module state was patched), the worker and its arguments are
pickled as with "spawn", and each rank first takes the starting process's environment, which
"forkserver" alone would not pass (the server's is the one it was started with), and runs the
exit handlers at its end, as a spawned rank's interpreter did (after a clean return: _in_environ).
"""

from __future__ import annotations

import atexit
import json
import os
from pathlib import Path
from typing import Any, NoReturn

# Imported by the fork server before its first rank: what nearly every rank imports anyway, and
# nothing that decides something at import from what a rank sets up first. transformers is left
# out for that reason: its DeepSpeed integration decides at import whether DeepSpeed is there,
# and tests/integrations/hf_zero3.py puts zerorun's shim on the path before that import.
PRELOAD = ["torch", "torch.distributed", "numpy", "zerorun", "zerorun.zero.engine"]
# The environment this module was imported with (collection time, before any test's monkeypatch):
# the server is started with it, so no test's temporary variables stay in the server for good.
_SESSION_ENVIRON = dict(os.environ)


def start_processes(entry, args: tuple, nprocs: int, join: bool = True):
    """torch.multiprocessing.start_processes(entry, args, nprocs) with forked ranks (Note [forked ranks])."""
    import torch.multiprocessing as mp

    _ensure_server()
    return mp.start_processes(_in_environ, args=(entry, dict(os.environ), args), nprocs=nprocs,
                              start_method="forkserver", join=join)


def _ensure_server() -> None:
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(PRELOAD)  # read when the server starts (the first world)
    current = dict(os.environ)
    os.environ.clear()
    os.environ.update(_SESSION_ENVIRON)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(current)


def _in_environ(rank: int, entry, environ: dict, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    entry(rank, *args)
    # A forked rank ends with os._exit, a spawned one with the interpreter's exit, which runs the
    # exit handlers (zerorun's Note [clean exit] registers one): run them here too. Only after a
    # clean return: a failing rank must not wait at the exit barrier for peers that may never come
    # (a spawned one skipped it too, its sys.exit(1) noted as failing: Note [failing exits]).
    atexit._run_exitfuncs()


def run_ranks(body, world: int, tmp: Path, *args, leave_together: bool = True) -> dict[int, Any]:
    """Note [one world helper]: ``{rank: body(rank, *args)}`` from ``world`` forked gloo ranks."""
    tmp.mkdir(parents=True, exist_ok=True)
    start_processes(_rank_body, (body, world, str(tmp), args, leave_together), world)
    return {rank: json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(world)}


# This rank's (rank, results folder) inside run_ranks: where end_rank_now delivers.
_delivery: tuple[int, str] | None = None


def _rank_body(rank: int, body, world: int, tmp: str, args: tuple, leave_together: bool) -> None:
    import contextlib

    import torch.distributed as dist

    from zerorun.zero.comm.process_group import leaving_together

    global _delivery
    _delivery = (rank, tmp)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    with leaving_together() if leave_together else contextlib.nullcontext():
        value = body(rank, *args)
    _deliver(value)


def _deliver(value: Any) -> None:
    assert _delivery is not None, "only a run_ranks body delivers a value"
    rank, tmp = _delivery
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(value))


def end_rank_now(value: Any) -> NoReturn:
    """Inside a run_ranks body after an error that broke the world: deliver ``value`` and end the
    rank here, as a script's process ends with its error (no exit barrier, no destroy waiting on
    a peer's collective that gloo still has in flight, such as the ring's receives)."""
    from zerorun.zero.comm.host_channel import close_host_channels

    _deliver(value)
    close_host_channels(finished=False)
    os._exit(0)


def spawn_and_collect(worker, out_dir: Path, world: int) -> dict[int, dict]:
    start_processes(worker, (str(out_dir / "rendezvous"), str(out_dir)), world)
    return {rank: json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world)}
