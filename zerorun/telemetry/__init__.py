"""Telemetry: worker-side recorder, launcher-side collector, event schema.

Contract with the runtime (zerorun/zero):
    from zerorun.telemetry import get_recorder
    rec = get_recorder()          # a no-op recorder when the launcher did not ask for telemetry
    rec.record_step(step=..., loss=..., loss_scale=..., lr=..., samples=..., step_time_s=...)
    rec.set_memory_breakdown(dict)  # engine.memory_breakdown(), sent with the next sample
Collectives reach the recorder as an observer of zerorun.zero.collectives.

Contract with the launcher: workers write newline-delimited JSON messages to the file
descriptor named by ZERORUN_TELEMETRY_FD, each carrying ZERORUN_RUN_TOKEN; the launcher
feeds every raw line to ``Collector.ingest``.
"""

from __future__ import annotations


class NullRecorder:
    """What get_recorder() returns when telemetry is off: every call does nothing."""

    def record_step(self, **fields) -> None:
        pass

    def set_memory_breakdown(self, breakdown: dict) -> None:
        pass


_recorder = None


def get_recorder():
    return _recorder if _recorder is not None else NullRecorder()
