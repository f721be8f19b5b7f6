"""pytest tests/unit/test_slurm.py — Slurm variables, node lists, ports and roles (pure, no Slurm needed).

The environments below are the ones Debian's Slurm 22.05 really sets (recorded on the private
test cluster of tests/e2e/slurm_cluster.py): an ``srun -N2 -n2`` task, a batch script and a
salloc shell.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerorun.errors import HostfileError, LaunchError
from zerorun.launch import slurm
from zerorun.worker import slurm_env
from zerorun.worker.slurm_env import expand_nodelist

SRUN_TASK = {  # srun -N2 -n2, task 1
    "SLURMD_NODENAME": "n2", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_CPUS_PER_NODE": "1(x2)", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": "n[1-2]",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_TASKS_PER_NODE": "1(x2)",
}
BATCH = {  # sbatch -N2 -n2: the script, on the first node
    "SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_CPUS_PER_NODE": "1(x2)",
    "SLURM_CPUS_ON_NODE": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
    "SLURM_TASKS_PER_NODE": "1(x2)",
}
SALLOC = {"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_CPUS_PER_NODE": "1(x2)",
          "SLURM_TASKS_PER_NODE": "1(x2)"}


@pytest.mark.parametrize("text, names", [
    ("n[1-2,5]", ["n1", "n2", "n5"]),
    ("prefix-00[1-3]", ["prefix-001", "prefix-002", "prefix-003"]),
    ("gpu[08-10],login1", ["gpu08", "gpu09", "gpu10", "login1"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
    ("node.example.org", ["node.example.org"]),
])
def test_hostlists_expand_like_scontrol_show_hostnames(text, names):
    assert expand_nodelist(text) == names


@pytest.mark.parametrize("bad", ["n[1-", "n]1[", "n[3-1]", "n[x]", "n,,m", "n[1-2]][", "r[1-2]n[0-99999]x[0-9]"])
def test_bad_hostlists_are_one_line_errors_naming_the_variable(bad):
    with pytest.raises(HostfileError) as err:
        expand_nodelist(bad, "SLURM_STEP_NODELIST")
    assert "SLURM_STEP_NODELIST" in str(err.value) and "\n" not in str(err.value)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab09-[],", max_size=20))
def test_hostlist_fuzz_gives_names_or_a_hostfile_error(text):
    try:
        names = expand_nodelist(text)
    except HostfileError:
        return
    assert names and all(name and "[" not in name and "," not in name for name in names)


def test_outside_slurm_nothing_is_detected():
    assert slurm.detect({}) is None
    assert slurm_env.step_world({}) is None


def test_a_step_is_detected_with_its_nodes_and_task():
    ctx = slurm.detect(SRUN_TASK)
    assert ctx.in_step and ctx.job_id == 1 and ctx.step_id == 0
    assert ctx.step_nodes == ("n1", "n2") and ctx.step_tasks == 2 and ctx.step_tasks_per_node == (1, 1)
    assert (ctx.node_id, ctx.proc_id, ctx.local_id, ctx.node_name, ctx.cpus_on_node) == (1, 1, 0, "n2", 1)
    assert "step 1.0" in ctx.where


def test_batch_script_and_salloc_shell_are_allocations_not_steps():
    batch, shell = slurm.detect(BATCH), slurm.detect(SALLOC)
    assert not batch.in_step and batch.node_name == "n1" and "batch script on n1" in batch.where
    assert not shell.in_step and shell.node_name is None and "salloc" in shell.where
    assert batch.job_nodes == shell.job_nodes == ("n1", "n2")


def test_special_step_ids_are_not_user_steps():
    assert not slurm.detect({**BATCH, "SLURM_STEP_ID": str(0xFFFFFFFB)}).in_step


def test_bad_numbers_are_one_line_errors():
    with pytest.raises(HostfileError, match="SLURM_NODEID='x'"):
        slurm.detect({**SRUN_TASK, "SLURM_NODEID": "x"})


def test_ports_derive_from_job_and_step_in_the_documented_range():
    ports = {slurm.master_port(job, step) for job in range(1000, 1100) for step in (None, 0, 1, 2)}
    assert len(ports) == 400  # neighbouring jobs and steps never share a port
    assert all(slurm_env.PORT_BASE <= p < slurm_env.PORT_BASE + slurm_env.PORT_SPAN for p in ports)
    assert slurm.master_port(7, 0) == slurm.master_port(7, 0)  # every node computes the same


def test_this_machine_is_known_by_node_name_short_and_full_host_names():
    names = slurm.local_names({"SLURMD_NODENAME": "n1"}, "c01.cluster.org", "c01.cluster.org")
    assert {"n1", "c01", "c01.cluster.org"} <= names
    assert slurm.local_names({}, "c01", "c01.cluster.org") >= {"c01", "c01.cluster.org"}


def test_one_launcher_per_node_is_one_job():
    role = slurm.step_role(slurm.detect(SRUN_TASK))
    assert role.node_rank == 1 and role.host == "n2" and role.master_addr == "n1"
    assert role.master_port == slurm.master_port(1, 0)
    assert slurm.step_role(slurm.detect(SRUN_TASK), port=1234).master_port == 1234


def test_two_launchers_on_one_node_are_refused_with_what_to_write():
    env = {**SRUN_TASK, "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0"}
    with pytest.raises(LaunchError) as err:
        slurm.step_role(slurm.detect(env))
    assert "2 zerorun launchers on node n1" in str(err.value) and "\n" not in str(err.value)
    assert "--ntasks-per-node=1" in err.value.hint


def test_srun_python_world_comes_from_the_step():
    world = slurm_env.step_world(SRUN_TASK)
    assert (world.rank, world.world_size, world.local_rank, world.master_addr) == (1, 2, 0, "n1")
    assert world.master_port == slurm.master_port(1, 0)
    assert slurm_env.step_world({**SRUN_TASK, "MASTER_PORT": "4000", "MASTER_ADDR": "x"}).master_port == 4000
    one = {**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    assert slurm_env.step_world(one) is None


def test_never_a_silent_world_of_one():
    with pytest.raises(LaunchError, match="SLURM_PROCID"):
        slurm_env.step_world({k: v for k, v in SRUN_TASK.items() if k != "SLURM_PROCID"})
    with pytest.raises(LaunchError, match="not started by srun"):
        slurm_env.step_world(BATCH)


def test_threads_share_out_the_cpus_slurm_gave():
    assert slurm.threads_per_worker(slurm.detect({**SRUN_TASK, "SLURM_CPUS_PER_TASK": "8"}), 2) == 4
    assert slurm.threads_per_worker(slurm.detect({**SALLOC, "SLURM_JOB_CPUS_PER_NODE": "16(x2)"}), 3) == 5
    assert slurm.threads_per_worker(slurm.detect(SRUN_TASK), 2) is None  # a step without --cpus-per-task
    assert slurm.threads_per_worker(slurm.detect({**SRUN_TASK, "SLURM_CPUS_PER_TASK": "1"}), 4) == 1
    assert slurm.threads_per_worker(None, 2) is None


def test_describe_names_the_allocation_nodes_reach_port_and_signals():
    text = "\n".join(slurm.describe(slurm.detect(SALLOC), {"n1": "srun", "n2": "srun"}, 20030, ["SIGUSR1: save"]))
    assert "salloc" in text and "n1: reached by srun" in text and "port 20030" in text and "SIGUSR1" in text


# Records as slurm-wlm 22.05 printed them at the moment of the SIGTERM (tests/e2e/slurm_cluster.py;
# Note [why Slurm sent SIGTERM] in zerorun/launch/slurm.py), shortened to the fields that matter.
RECORD = ("JobId=4 JobName=job.sh UserId=root(0) JobState={state} Reason={reason} Dependency=(null) Requeue=1 "
          "Restarts={restarts} BatchFlag=1 ExitCode=0:0 RunTime=00:01:26 TimeLimit=00:01:00 "
          "StartTime=2026-11-26T04:03:05 EndTime=2026-11-26T04:04:31 PreemptEligibleTime=2026-11-26T04:03:05 "
          "PreemptTime={preempt} SuspendTime=None Partition=low Command=/tmp/job.sh /tmp/a=b WorkDir=/tmp")


@pytest.mark.parametrize("state, reason, restarts, preempt, at_start, cause", [
    ("COMPLETING", "None", 0, "None", 0, "cancelled"),  # scancel
    ("CANCELLED", "None", 0, "None", 0, "cancelled"),
    ("COMPLETING", "TimeLimit", 0, "None", 0, "time limit"),
    ("TIMEOUT", "TimeLimit", 0, "None", 0, "time limit"),
    ("RUNNING", "None", 0, "2026-11-26T04:04:58", 0, "preempted"),  # GraceTime 30: steps signalled
    ("PREEMPTED", "None", 0, "None", 0, "preempted"),
    ("COMPLETING", "None", 1, "None", 0, "requeued"),  # GraceTime 0, PreemptMode=REQUEUE
    ("COMPLETING", "None", 3, "None", 3, "cancelled"),  # a requeued job's own scancel
    ("NODE_FAIL", "None", 0, "None", 0, "node failure"),
    ("COMPLETING", "NodeDown", 0, "None", 0, "node failure"),
    ("RUNNING", "None", 0, "None", 0, None),  # scancel --signal=TERM, kill: Slurm is not ending it
])
def test_why_slurm_sent_sigterm_comes_from_the_job_record(state, reason, restarts, preempt, at_start, cause):
    record = slurm.parse_job_record(RECORD.format(state=state, reason=reason, restarts=restarts, preempt=preempt))
    assert record["Command"] == "/tmp/job.sh" and record["WorkDir"] == "/tmp"
    assert slurm.stop_cause(record, at_start) == cause


# ``scontrol -o show node n1,n2`` (slurm-wlm 22.05) 48 s after n2's slurmd was frozen, shortened; at
# 24 s n2 read State=IDLE+NOT_RESPONDING.
NODES = ("NodeName=n1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=4 State=IDLE ThreadsPerCore=1 Partitions=debug\n"
         "NodeName=n2 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=4 State=DOWN+NOT_RESPONDING Partitions=debug "
         "Reason=Not responding [slurm@2026-11-26T07:40:02]\n")


def test_the_down_nodes_are_read_from_scontrol():
    assert slurm.down_nodes(NODES) == ["n2"]
    assert slurm.down_nodes(NODES.replace("DOWN+NOT_RESPONDING", "IDLE+NOT_RESPONDING")) == ["n2"]  # before DOWN
    assert slurm.down_nodes(NODES.replace("DOWN+NOT_RESPONDING", "ALLOCATED")) == []
    assert slurm.down_nodes("") == []


def test_a_job_requeued_while_its_node_is_down_ended_of_a_node_failure():
    """Batch jobs are requeued after NODE_FAIL by default: the record then says only "requeued"."""
    requeued = slurm.parse_job_record(RECORD.format(state="PENDING", reason="BeginTime", restarts=1, preempt="None"))
    assert slurm.stop_cause(requeued, 0) == "requeued"
    assert slurm.stop_cause(requeued, 0, down=["n2"]) == "node failure"
    running = slurm.parse_job_record(RECORD.format(state="RUNNING", reason="None", restarts=0, preempt="None"))
    assert slurm.stop_cause(running, 0, down=["n2"]) is None  # Slurm is not ending this job (yet)


def test_without_a_record_only_the_time_limit_can_be_told():
    assert slurm.stop_cause(None, end_time=1000, now=995.0) == "time limit"
    assert slurm.stop_cause(None, end_time=1000, now=900.0) is None
    assert slurm.stop_cause(None) is None


def test_the_restart_count_and_array_task_are_read():
    ctx = slurm.detect({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2", "SLURM_ARRAY_TASK_ID": "3"})
    assert ctx is not None and ctx.restart_count == 2 and ctx.array_task_id == 3
    assert slurm.detect({"SLURM_JOB_ID": "7"}).restart_count == 0
