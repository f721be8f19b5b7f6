"""Every worker visible from its first moment, whatever the script (Note [any script is visible]).

The launcher puts this directory first on each worker's PYTHONPATH (launch/plan.py), so Python's
``site`` imports this module at start-up, before the script. It starts the worker's telemetry
recorder (zerorun/telemetry/recorder.py: a hello, then memory samples every interval) without
importing torch: a plain torch/DDP, FSDP2 or Accelerate script that never calls
``zerorun.initialize`` still shows its memory and elapsed time on the dashboard, in the summary
and in ``zerorun report``. ``zerorun.initialize`` later finds the same recorder, which starts
observing zerorun's collectives then. Only the worker itself starts one: a process it starts in
turn gets neither the pipe nor its variable, and stays silent (recorder_from_env).

Then whatever ``sitecustomize`` the worker would have imported without us (further on the path)
is imported as before.
"""

import os
import sys


def _start_telemetry() -> None:
    if not os.environ.get("ZERORUN_TELEMETRY_FD"):
        return
    try:
        from zerorun.telemetry import get_recorder

        get_recorder()
    except Exception:  # never fail a worker's start-up over its telemetry
        pass


def _chain() -> None:
    """Import the ``sitecustomize`` this one shadows, if there is one."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_start_telemetry()
_chain()
