"""Telemetry: worker-side recorder, launcher-side collector, event schema.

Contract with the runtime (zerorun/zero):
    from zerorun.telemetry import get_recorder
    rec = get_recorder()          # a no-op recorder when the launcher did not ask for telemetry
    rec.record_step(step=..., loss=..., loss_scale=..., lr=..., samples=..., step_time_s=...)
        # samples (and optional tokens): what THIS rank processed in the step; the dashboard
        # sums ranks for job throughput. Numbers or 0-d tensors; None when unknown.
    rec.set_memory_breakdown(dict)  # engine.memory_breakdown(), sent with the next sample
    rec.set_total_steps(n)          # engine.set_total_steps(n): each step message carries it
    rec.record_activity(what, n)    # "saving" and the bytes written so far (None: done); each
                                    # sample carries it, so a long save counts as progress
    rec.announce_monitor(section)   # rank 0: the config's ``monitor`` section, for the launcher
                                    # to write (telemetry/monitor.py, Note [one writer])
Collectives reach the recorder as an observer of zerorun.zero.comm.collectives.

Contract with the launcher: workers write newline-delimited JSON messages to the file
descriptor named by ZERORUN_TELEMETRY_FD, each carrying ZERORUN_RUN_TOKEN; the launcher
feeds every raw line to ``Collector.ingest`` (through ``JobView.on_telemetry``).
Worker env read here: ZERORUN_TELEMETRY_FD, ZERORUN_RUN_TOKEN, ZERORUN_TELEMETRY_INTERVAL
(seconds between samples, default 1), RANK, WORLD_SIZE, ZERORUN_HOST.
Modules: events.py (wire schema), recorder.py (worker), collector.py (launcher).
"""

from __future__ import annotations

import threading


class NullRecorder:
    """What get_recorder() returns when telemetry is off: every call does nothing."""

    enabled = False

    def record_step(self, **fields) -> None:
        pass

    def set_memory_breakdown(self, breakdown: dict) -> None:
        pass

    def set_total_steps(self, total_steps: int) -> None:
        pass

    def record_activity(self, what, nbytes: int) -> None:
        pass

    def send_sample(self) -> None:
        pass

    def announce_monitor(self, section: dict) -> None:
        pass


_recorder = None
_created = False
_create_lock = threading.Lock()


def get_recorder():
    """The process's recorder: created (once, lazily) when ZERORUN_TELEMETRY_FD is set."""
    global _recorder, _created
    if not _created:
        with _create_lock:
            if not _created:
                from zerorun.telemetry.recorder import recorder_from_env

                _recorder = recorder_from_env()
                _created = True
    if _recorder is None:
        return NullRecorder()
    _recorder.observe_collectives()  # started before the engine existed (worker/boot): see its collectives
    return _recorder


def announce_monitor(monitor_config, rank: int) -> None:
    """Rank 0 tells the launcher which monitor files to write (Note [one writer] in monitor.py):
    the section as a dict, with relative ``output_path``s made absolute here, in the worker's own
    directory. Without a launcher nothing is written, and rank 0 says so once."""
    import dataclasses
    import os
    import sys

    if rank != 0 or not monitor_config.enabled:
        return
    section = dataclasses.asdict(monitor_config)
    for part in section.values():
        if "output_path" in part:
            part["output_path"] = os.path.abspath(os.path.expanduser(part["output_path"] or ""))
    recorder = get_recorder()
    if not recorder.enabled:
        print("zerorun: note: the monitor section (tensorboard, csv, wandb) is written by the zerorun launcher "
              "from its telemetry; started without it (or with telemetry.enabled: false) nothing is written",
              file=sys.stderr, flush=True)
        return
    recorder.announce_monitor(section)
