"""Imported by tests/distributed/* and tests/integrations/hf_world.py: start small gloo worlds
quickly, and spawn one and collect every rank's result.

The worker of ``spawn_and_collect`` is ``worker(rank, rendezvous_file, out_dir)``: it joins with
a ``file://`` init method (no ports to race for) and writes ``out_dir/rank{R}.json``.

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


def spawn_and_collect(worker, out_dir: Path, world: int) -> dict[int, dict]:
    start_processes(worker, (str(out_dir / "rendezvous"), str(out_dir)), world)
    return {rank: json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world)}
