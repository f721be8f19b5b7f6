"""pytest tests/unit/test_plan.py — rank/env planning and host resolution (pure, no processes)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerorun.errors import HostfileError, LaunchError
from zerorun.launch.job_hosts import resolve_hosts
from zerorun.launch.prepare import LaunchOptions, prepare
from zerorun.launch.plan import Target, build_plan, describe_plan

TOKEN = "deadbeef" * 4


def plan_for(hosts, **kwargs):
    defaults = dict(python="/py", cwd="/job", run_dir="/job/run", token=TOKEN, master_port=29500)
    return build_plan(hosts, Target(script="train.py", args=("--lr", "3e-4")), **{**defaults, **kwargs})


def test_ranks_are_numbered_host_by_host_like_torchrun():
    plan = plan_for({"localhost": [0, 1], "node-b": [0, 1, 2]})
    table = [(w.host, w.rank, w.local_rank, w.env["LOCAL_WORLD_SIZE"], w.env["NODE_RANK"]) for w in plan.workers]
    assert table == [
        ("localhost", 0, 0, "2", "0"),
        ("localhost", 1, 1, "2", "0"),
        ("node-b", 2, 0, "3", "1"),
        ("node-b", 3, 1, "3", "1"),
        ("node-b", 4, 2, "3", "1"),
    ]
    assert plan.world_size == 5
    assert [n.local for n in plan.nodes] == [True, False]
    # "localhost" would point every remote rank at itself: the master gets this machine's name.
    assert plan.master_addr == "localhost"  # build_plan's default this_host_name
    named = plan_for({"localhost": [0], "node-b": [0]}, this_host_name="node-a")
    assert {w.env["MASTER_ADDR"] for w in named.workers} == {"node-a"}
    loopback = plan_for({"127.0.0.1": [0], "127.0.0.2": [0]}, this_host_name="node-a")
    assert loopback.master_addr == "127.0.0.1"


def test_worker_env_carries_torchrun_and_zerorun_variables():
    worker = plan_for({"localhost": [0, 1]}).workers[1]
    assert worker.argv == ["/py", "-u", "train.py", "--lr", "3e-4"]
    env = worker.env
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("1", "2", "127.0.0.1", "29500")
    assert env["ZERORUN_CONFIG"] == "/job/run/config.json"
    assert env["ZERORUN_RUN_DIR"] == "/job/run"
    assert env["ZERORUN_RUN_TOKEN"] == TOKEN
    assert env["ZERORUN_HOST"] == "localhost"
    assert env["OMP_NUM_THREADS"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_user_thread_count_and_visible_devices():
    plan = plan_for({"localhost": [1, 3]}, inherited_env={"OMP_NUM_THREADS": "4"}, set_visible_devices=True)
    assert "OMP_NUM_THREADS" not in plan.workers[0].env
    assert plan.workers[0].env["CUDA_VISIBLE_DEVICES"] == "1,3"


def test_module_target_and_master_override():
    plan = build_plan({"a": [0]}, Target(module="pkg.train"), python="/py", cwd="/", run_dir="/r", token="t",
                      master_port=1234, master_addr="10.0.0.1")
    assert plan.workers[0].argv == ["/py", "-u", "-m", "pkg.train"]
    assert plan.workers[0].env["MASTER_ADDR"] == "10.0.0.1"


def test_target_needs_exactly_one_of_script_and_module():
    with pytest.raises(LaunchError):
        Target()
    with pytest.raises(LaunchError):
        Target(script="a.py", module="b")


def test_bad_master_port_is_a_launch_error():
    with pytest.raises(LaunchError, match="--master-port"):
        plan_for({"a": [0]}, master_port=70000)


@settings(deadline=None)  # a loaded CI machine must not turn slowness into failure
@given(st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True), min_size=1, max_size=5))
def test_plan_invariants(slot_lists):
    hosts = {f"h{i}": slots for i, slots in enumerate(slot_lists)}
    plan = plan_for(hosts)
    ranks = [w.rank for w in plan.workers]
    assert ranks == list(range(sum(map(len, slot_lists))))
    assert all(w.env["WORLD_SIZE"] == str(len(ranks)) for w in plan.workers)
    for node, slots in zip(plan.nodes, slot_lists, strict=True):
        assert [w.local_rank for w in node.workers] == list(range(len(slots)))
        assert all(w.env["LOCAL_WORLD_SIZE"] == str(len(slots)) for w in node.workers)
    assert len({w.env["MASTER_ADDR"] for w in plan.workers}) == 1


def test_dry_run_description_shows_plan_but_hides_the_token():
    plan = plan_for({"localhost": [0], "node-b": [0]})
    text = describe_plan(plan, {"node-b": ["ssh", "node-b", "cmd"]})
    assert TOKEN not in text
    assert "ZERORUN_RUN_TOKEN=***" in text
    assert "rank 1 (local 0): /py -u train.py --lr 3e-4" in text
    assert "host node-b (node 1, ssh, 1 worker(s))" in text
    assert "agent: ssh node-b cmd" in text


def options(**kwargs):
    return LaunchOptions(target=Target(script="train.py"), **kwargs)


def test_gpus_without_gpus_is_one_clear_error():
    with pytest.raises(LaunchError) as info:
        resolve_hosts(options(gpus=2), {"CUDA_VISIBLE_DEVICES": "0"}, gpu_counter=lambda: 1)
    assert str(info.value) == "--gpus 2 asks for 2 GPU(s) but this machine has 1 visible (CUDA_VISIBLE_DEVICES=0)"
    assert resolve_hosts(options(gpus=2), {}, gpu_counter=lambda: 2) == {"localhost": [0, 1]}


def test_local_nproc_and_conflicts():
    assert resolve_hosts(options(nproc=3), {}) == {"localhost": [0, 1, 2]}
    assert resolve_hosts(options(), {}) == {"localhost": [0]}
    with pytest.raises(LaunchError, match="cannot be used together"):
        resolve_hosts(options(nproc=2, gpus=2), {})
    with pytest.raises(LaunchError, match="--nproc must be at least 1"):
        resolve_hosts(options(nproc=0), {})


def test_hostfile_with_per_host_cap(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=4\nb slots=1\n")
    assert resolve_hosts(options(hostfile=str(hostfile), nproc=1), {}) == {"a": [0], "b": [0]}
    with pytest.raises(LaunchError, match="b has only 1 slot"):
        resolve_hosts(options(hostfile=str(hostfile), nproc=2), {})
    with pytest.raises(HostfileError, match="does not exist"):
        resolve_hosts(options(hostfile=str(tmp_path / "nope")), {})


def test_slurm_environment_is_a_host_source():
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS_PER_NODE": "2"}
    assert resolve_hosts(options(), env) == {"n1": [0, 1], "n2": [0, 1]}


def test_prepare_validates_script_and_config_before_anything_starts(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    job = prepare(options(nproc=2, run_dir=str(tmp_path / "run")), environ={}, cwd=str(tmp_path))
    assert job.plan.world_size == 2
    assert not (tmp_path / "run").exists()  # prepare writes nothing
    assert '"zero"' in job.config_json
    with pytest.raises(LaunchError, match="script missing.py not found"):
        prepare(LaunchOptions(target=Target(script="missing.py")), environ={}, cwd=str(tmp_path))
