"""pytest tests/unit/test_watchdog.py — hang judgements (pure): progress, faulthandler stacks, blame."""

from __future__ import annotations

from zerorun.launch.watchdog import (
    COLLECTIVE_FILES,
    LIBRARY_FILES,
    Frame,
    ProgressWatch,
    activity,
    blame,
    describe_activity,
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


def test_start_up_is_not_a_hang_until_every_rank_has_joined():
    watch = ProgressWatch(10.0, now=0.0, ranks=(0, 1))
    assert not watch.expired(100.0) and watch.idle_s(100.0) == 0.0  # both still importing
    watch.rank_started(0, now=100.0)
    assert not watch.expired(200.0)  # rank 1 is still starting
    watch.rank_started(1, now=200.0)
    assert not watch.expired(209.0) and watch.expired(210.0)  # the clock starts at the last join
    assert not watch.startup_expired(1e9)  # no start-up limit by default


def test_start_up_limit_counts_from_launch_and_only_while_starting():
    watch = ProgressWatch(10.0, now=0.0, ranks=(0, 1), startup_timeout_s=60.0)
    watch.rank_started(1, now=5.0)
    assert not watch.startup_expired(59.0) and watch.startup_expired(60.0)
    assert watch.starting == {0}
    watch.rank_started(0, now=61.0)
    assert not watch.startup_expired(1e9)


IMPORTING = """\
Fatal Python error: Aborted

Current thread 0x00007f0000000002 (most recent call first):
  File "<frozen importlib._bootstrap>", line 241 in _call_with_frames_removed
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 12 in <module>
  File "<frozen importlib._bootstrap>", line 1204 in _find_and_load
  File "/venv/lib/python3.11/site-packages/torch/optim/sgd.py", line 30 in __init__
  File "/job/train.py", line 8 in <module>
""".splitlines()


def test_a_rank_importing_torch_distributed_is_not_waiting_in_a_collective():
    importing = main_stack(parse_fault_stacks(IMPORTING))
    waiting = main_stack(parse_fault_stacks(WAITING))
    assert activity(importing) == "importing" and not in_collective(importing)
    assert describe_activity(importing) == "importing modules"
    assert activity(waiting) == "collective" and describe_activity(waiting) == "waiting in a collective"
    # Nobody waits in a collective, so nobody is blamed for holding the others up.
    assert blame({0: importing, 1: main_stack(parse_fault_stacks(STUCK))}) == []


def test_runtime_paths_follow_the_modules():
    import zerorun.telemetry.recorder
    import zerorun.zero.comm.collectives

    assert any(part in zerorun.zero.comm.collectives.__file__ for part in COLLECTIVE_FILES)
    assert any(part in zerorun.telemetry.recorder.__file__ for part in LIBRARY_FILES)


def test_a_rank_that_printed_no_stack_is_blamed_when_every_stack_shown_waits():
    """Issue 31 item 11: a SIGSTOPped rank cannot print its stack; the others all wait in a
    collective, so the silent one is the one they wait for (it used to go unnamed)."""
    waiting = main_stack(parse_fault_stacks(WAITING))
    assert blame({0: waiting}, ranks=(0, 1)) == [1]
    assert blame({0: waiting, 1: waiting}, ranks=(0, 1)) == []  # every rank printed and waits
    assert blame({0: main_stack(parse_fault_stacks(STUCK))}, ranks=(0, 1)) == []  # nobody waits


def test_the_rank_a_failure_names_as_its_cause():
    from zerorun.launch.watchdog import cause_named

    assert cause_named(["x", "zerorun: error: rank 0: setting up NVMe offload failed on rank 1 (its error says why)",
                        "zerorun: hint: nothing was started"]) == 1
    assert cause_named(["[rank0]: zerorun: error: rank 3 (pid 42) exited while this rank waited for it in a "
                        "collective"]) == 3
    assert cause_named(["Traceback (most recent call last):", "ValueError: bad batch"]) is None


def test_the_closing_block_names_the_rank_the_first_failure_blamed():
    """Issue 31 item 12: the rank that exited first was named even when its own error said it
    failed because of another rank, which exited a moment later with the real cause."""
    import collections
    import types

    from zerorun.launch.plan import Target, build_plan
    from zerorun.launch.supervisor import Supervisor

    plan = build_plan({"localhost": [0, 1]}, Target(script="t.py"), python="py", cwd="/w", run_dir="/r",
                      token="t", master_port=29500, local_names={"localhost"})
    view = types.SimpleNamespace(on_worker_exit=lambda host, rank, rc: None)
    supervisor = Supervisor(plan, view)
    for channel in supervisor.channels:
        channel.stop = lambda: None  # no agent runs here
    # What run() sets up before it reads the first event.
    supervisor._failure, supervisor._exit_codes, supervisor._running = None, {}, {0, 1}
    supervisor._tails[0] = collections.deque(
        ["zerorun: error: rank 0: setting up NVMe offload failed on rank 1 (its error says why)"])
    supervisor._tails[1] = collections.deque(["zerorun: error: zero.offload_param.nvme_path: its file system has 8 KiB free"])
    supervisor._handle("localhost", {"t": "exit", "rank": 0, "rc": 1})
    assert supervisor._failure.rank == 0
    supervisor._handle("localhost", {"t": "exit", "rank": 1, "rc": 1})
    supervisor._drain()  # the job's end: the cause is settled on the complete logs
    assert supervisor._failure.rank == 1 and "8 KiB free" in supervisor._failure.log_tail[-1]


def _two_rank_supervisor():
    """A supervisor of ranks 0 and 1 on localhost, as run() leaves it before the first event."""
    import collections
    import types

    from zerorun.launch.plan import Target, build_plan
    from zerorun.launch.supervisor import Supervisor

    plan = build_plan({"localhost": [0, 1]}, Target(script="t.py"), python="py", cwd="/w", run_dir="/r",
                      token="t", master_port=29500, local_names={"localhost"})
    supervisor = Supervisor(plan, types.SimpleNamespace(on_worker_exit=lambda host, rank, rc: None))
    for channel in supervisor.channels:
        channel.stop = lambda: None  # no agent runs here
    supervisor._failure, supervisor._exit_codes, supervisor._running = None, {}, {0, 1}
    supervisor._tails[0] = collections.deque(["Traceback (most recent call last):", '  File "job.py", line 8',
                                              "RuntimeError: deliberate failure on rank 0"])
    supervisor._tails[1] = collections.deque(["step 3"])
    return supervisor


BLAMES_RANK_0 = "[rank1] zerorun: error: rank 0 (pid 42) closed its inbox during a collective"


def test_the_cause_is_the_rank_the_blaming_rank_names_when_its_line_comes_after_its_exit():
    """Issue 38 (messages): rank 1's exit reached the launcher before its last line (the agent
    waits for a rank's lines a second only) and before rank 0's exit; the closing block named
    rank 1 while rank 1's own line blamed rank 0."""
    supervisor = _two_rank_supervisor()
    supervisor._handle("localhost", {"t": "exit", "rank": 1, "rc": 1})
    supervisor._tails[1].append(BLAMES_RANK_0)  # its last line, after its exit
    supervisor._handle("localhost", {"t": "exit", "rank": 0, "rc": 1})
    supervisor._drain()
    failure = supervisor._failure
    assert (failure.rank, failure.reason, failure.returncode) == (0, "exit code 1", 1), failure
    assert failure.traceback[-1] == "RuntimeError: deliberate failure on rank 0"


def test_the_named_rank_is_the_cause_even_when_the_launchers_stop_ended_it():
    """Rank 1 blamed rank 0 and exited first; the launcher's stop then reached rank 0, still
    exiting after its own error: the cause is rank 0, and the reason says how it ended."""
    supervisor = _two_rank_supervisor()
    supervisor._tails[1].append(BLAMES_RANK_0)
    supervisor._handle("localhost", {"t": "exit", "rank": 1, "rc": 1})
    supervisor._handle("localhost", {"t": "exit", "rank": 0, "rc": -15})
    supervisor._drain()
    failure = supervisor._failure
    assert failure.rank == 0 and failure.returncode == -15, failure
    assert failure.reason == ("rank 1's error names it as the cause; it was still exiting when the launcher "
                              "stopped it (signal SIGTERM)")
    assert failure.traceback[-1] == "RuntimeError: deliberate failure on rank 0"


def test_a_rank_named_as_the_cause_that_ended_well_is_not_the_cause():
    supervisor = _two_rank_supervisor()
    supervisor._tails[1].append(BLAMES_RANK_0)
    supervisor._handle("localhost", {"t": "exit", "rank": 0, "rc": 0})
    supervisor._handle("localhost", {"t": "exit", "rank": 1, "rc": 1})
    supervisor._drain()
    assert supervisor._failure.rank == 1 and supervisor._failure.log_tail[-1] == BLAMES_RANK_0


def test_a_job_whose_every_rank_is_exiting_gets_the_exit_allowance_not_the_hang_timeout():
    """Note [exiting is not a hang]: under load (pytest --busy 2) a job that had saved and ended
    its script was ended as a HANG 4 s into the interpreter's teardown (test_faults' slow save)."""
    from zerorun.launch.watchdog import EXIT_ALLOWANCE_S, ProgressWatch

    watch = ProgressWatch(4.0, 0.0)
    assert watch.expired(5.0)  # training and silent for 5 s: a hang
    watch.exiting = True
    assert not watch.expired(5.0) and not watch.expired(EXIT_ALLOWANCE_S - 0.1)
    assert watch.expired(EXIT_ALLOWANCE_S)  # a teardown that never ends is still one
    long = ProgressWatch(600.0, 0.0)
    long.exiting = True
    assert not long.expired(599.0) and long.expired(600.0)  # a longer --hang-timeout is kept
