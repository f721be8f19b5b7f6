"""pytest tests/unit/test_watchdog.py — hang judgements (pure): progress, faulthandler stacks, blame."""

from __future__ import annotations

from zerorun.launch.watchdog import (
    Frame,
    ProgressWatch,
    blame,
    in_collective,
    main_stack,
    parse_fault_stacks,
    stuck_at,
)

WAITING = """\
ready
Fatal Python error: Aborted

Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/app/zerorun/telemetry/recorder.py", line 190 in _sample_loop

Current thread 0x00007f0000000002 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/job/train.py", line 32 in <module>

Extension modules: torch._C (total: 1)
""".splitlines()

STUCK = """\
Fatal Python error: Aborted

Current thread 0x00007f0000000002 (most recent call first):
  File "/job/train.py", line 26 in stuck_here
  File "/job/train.py", line 28 in <module>
""".splitlines()


def test_parse_fault_stacks_reads_every_thread_and_finds_the_main_one():
    threads = parse_fault_stacks(WAITING)
    assert len(threads) == 2
    main = main_stack(threads)
    assert main[-1] == Frame("/job/train.py", 32, "<module>")
    assert in_collective(main) and not in_collective(threads[0])
    assert stuck_at(main) == Frame("/job/train.py", 32, "<module>")
    assert parse_fault_stacks(["no dump here", "  File \"x\", line 1 in y"]) == []


def test_blame_names_the_rank_outside_the_collective():
    stacks = {0: main_stack(parse_fault_stacks(WAITING)), 1: main_stack(parse_fault_stacks(STUCK))}
    assert stuck_at(stacks[1]) == Frame("/job/train.py", 26, "stuck_here")
    assert blame(stacks) == [1]
    assert blame(stacks, missing=(2,)) == [2]  # zerorun's own collectives know best
    assert blame({0: stacks[0], 1: stacks[0]}) == []  # every rank waits: nobody to blame
    assert blame({0: stacks[1], 1: stacks[1]}) == []  # nobody waits: not a collective hang


def test_progress_watch_times_out_only_without_any_change():
    watch = ProgressWatch(10.0, now=0.0)
    watch.observe({0: (1, 5)}, now=1.0)
    assert not watch.expired(10.5)
    watch.observe({0: (1, 5)}, now=9.0)  # same marks: no progress
    assert watch.expired(11.0) and watch.idle_s(11.0) == 10.0
    watch.progress(11.0)  # e.g. a line of output
    assert not watch.expired(20.0)
    assert not ProgressWatch(0.0, now=0.0).expired(1e9)  # 0 = never
