"""pytest tests/unit/test_local_rank_arg.py — ``zerorun --local-rank-arg``: DeepSpeed's ``--local_rank=N``.

DeepSpeed's launcher appends ``--local_rank=N`` to every worker's arguments and most of its
examples read it. zerorun does the same when asked, and by default when the job is started with
DeepSpeed's spellings or the script is given ``--deepspeed``/``--deepspeed_config``.
"""

from __future__ import annotations

import pytest

from zerorun.cli.run import route_run_argv, wants_local_rank_arg
from zerorun.launch.plan import Target, build_plan


def _argv(target: Target) -> list[list[str]]:
    plan = build_plan({"localhost": [0, 1]}, target, python="/py", cwd="/w", run_dir="/r", token="t",
                      master_port=29500)
    return [worker.argv for worker in plan.workers]


def test_each_worker_gets_its_own_local_rank_appended_last():
    argv = _argv(Target(script="train.py", args=("--deepspeed",), local_rank_arg=True))
    assert argv == [["/py", "-u", "train.py", "--deepspeed", "--local_rank=0"],
                    ["/py", "-u", "train.py", "--deepspeed", "--local_rank=1"]]
    assert _argv(Target(module="pkg.train", local_rank_arg=True))[1][-1] == "--local_rank=1"
    assert _argv(Target(script="train.py", args=("--deepspeed",)))[0] == ["/py", "-u", "train.py", "--deepspeed"]


@pytest.mark.parametrize("argv, on", [
    (["--num_gpus", "2", "train.py"], True),                      # DeepSpeed's launcher spelling
    (["--num_gpus=2", "train.py"], True),
    (["--deepspeed_config", "ds.json", "--nproc", "2", "train.py"], True),
    (["--nproc", "2", "train.py", "--deepspeed"], True),          # the script is DeepSpeed's
    (["--nproc", "2", "train.py", "--deepspeed_config=ds.json"], True),
    (["--nproc", "2", "-m", "pkg.train", "--deepspeed"], True),
    (["--nproc", "2", "train.py", "--lr", "3e-4"], False),
    (["--gpus", "2", "train.py"], False),
    (["--nproc", "2", "--no-local-rank-arg", "train.py", "--deepspeed"], False),  # said no
    (["--nproc", "2", "--local_rank_arg", "train.py"], True),                      # said yes
])
def test_local_rank_arg_is_on_with_deepspeed_habits(argv, on):
    routed = route_run_argv(argv, gpu_counter=lambda: 0)
    ours = routed[: routed.index("--")] if "--" in routed else routed
    assert ("--local-rank-arg" in ours) is on
    assert ours.count("--local-rank-arg") + ours.count("--no-local-rank-arg") <= 1


def test_the_decision_reads_only_the_sides_it_should():
    # A script option that merely contains the word is not DeepSpeed's flag.
    assert not wants_local_rank_arg(["--nproc", "2"], ["--deepspeed-like", "x"])
    assert wants_local_rank_arg(["--num_nodes", "1"], [])
