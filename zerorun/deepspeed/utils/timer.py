"""``deepspeed.utils.timer.ThroughputTimer``: ``engine.tput_timer``, read from the engine's own counters.

    pytest tests/unit/test_deepspeed_surface.py -k tput

DeepSpeed's engine starts and stops this timer around each forward and step; DeepSpeed-Chat
calls ``update_epoch_count()`` at each epoch's end and reads ``avg_samples_per_sec()``. Here the
engine already counts optimizer steps, so the timer derives the rate from them: samples of every
applied or skipped step (``train_batch_size`` each) over the time since the first step ended
(the first step carries start-up costs, as DeepSpeed's timer skips its first steps too).
"""

from __future__ import annotations

import time


class ThroughputTimer:
    def __init__(self, engine):
        self._engine = engine
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self._first: tuple[int, float] | None = None  # (global step, time) when first seen after a step

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """A no-op: the engine's counters are the clock."""

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """A no-op: the engine's counters are the clock."""

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the steps since the first one; 0.0 before two steps ended."""
        steps = self._engine.global_steps
        self.global_step_count = steps
        now = time.perf_counter()
        if self._first is None or steps < self._first[0]:
            if steps >= 1:
                self._first = (steps, now)
            return 0.0
        done = steps - self._first[0]
        elapsed = now - self._first[1]
        if done <= 0 or elapsed <= 0:
            return 0.0
        return done * self._engine.train_batch_size() / elapsed
