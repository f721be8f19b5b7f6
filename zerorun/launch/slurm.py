"""What a Slurm allocation tells a launcher, and the plans made from it (pure).

Every function here is a pure function of an environment mapping (and host names passed in),
so the unit tests fake any allocation without Slurm. Three places a zerorun process can find
itself in (Note [three Slurm places]):

* **outside Slurm**: no ``SLURM_JOB_ID``; nothing here applies.
* **in an allocation, not in a step**: the ``sbatch`` script (``SLURMD_NODENAME`` set, it runs on
  the first node) or the ``salloc`` shell (on the submit host, no ``SLURMD_NODENAME``). The
  launcher plans the whole allocation and starts one agent per node with ``srun`` (commands.py).
* **in a step**: started by ``srun`` (``SLURM_STEP_ID`` set). ``srun zerorun`` with one task per
  node is one launcher per node, each running its own node's workers; the node rank is
  ``SLURM_NODEID`` and rank 0's node is the first of ``SLURM_STEP_NODELIST``, as torchrun under
  srun. More than one task on a node would start the job twice: refused (``step_role``).
  ``srun python train.py`` (no zerorun) forms its world from the same variables
  (``step_world`` in zerorun/worker/slurm_env.py, called by zerorun/zero/comm/process_group.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from zerorun.errors import LaunchError
# The launcher's view of Slurm is built on what any process reads from it (worker/slurm_env.py);
# detect, SlurmContext and master_port stay reachable as slurm.X for the launcher's modules.
from zerorun.worker.slurm_env import SlurmContext, detect, master_port

__all__ = ["SlurmContext", "detect", "master_port"]

# The signals Slurm sends a job, and what each one means to the launcher (Note [Slurm signals]
# in signals.py): SIGTERM on scancel, at the time limit and on preemption; the one chosen with
# --signal=[B:]SIG@SECONDS (USR1 by convention) shortly before the time limit.
SIGNAL_MEANINGS = {
    "SIGTERM": "cancelled (scancel), time limit or preemption",
    "SIGHUP": "the terminal or salloc session went away",
    "SIGUSR1": "time limit near (sbatch --signal=B:USR1@SECONDS)",
    "SIGUSR2": "time limit near (sbatch --signal=B:USR2@SECONDS)",
}


def local_names(environ: Mapping[str, str], hostname: str, fqdn: str | None = None) -> set[str]:
    """Every name under which this machine may appear in a node list.

    Slurm's node name (SLURMD_NODENAME) need not be the host name (NodeName vs NodeHostname),
    and node lists usually hold short names where ``hostname`` prints the full one (or the
    other way round): all of them mean "this machine", which is never reached over the network.
    """
    names = {hostname, hostname.split(".", 1)[0]}
    if fqdn:
        names |= {fqdn, fqdn.split(".", 1)[0]}
    if environ.get("SLURMD_NODENAME"):
        names.add(environ["SLURMD_NODENAME"])
    return {name for name in names if name}


@dataclass(frozen=True)
class StepRole:
    """What one ``srun ... zerorun`` launcher does: its node of the step's one job."""

    nodes: tuple[str, ...]  # the step's nodes, in node-rank order
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def host(self) -> str:
        return self.nodes[self.node_rank]


def step_role(ctx: SlurmContext, port: int | None = None) -> StepRole:
    """This launcher's node in a job made of one launcher per node of an ``srun`` step.

    Raises LaunchError (one line, with what to write instead) for a layout that would run the
    job more than once: more than one task on a node.
    """
    if not ctx.in_step:
        raise LaunchError("not inside a Slurm step (SLURM_STEP_ID is not set)")
    counts = ctx.step_tasks_per_node or (1,) * len(ctx.step_nodes)
    crowded = [(node, count) for node, count in zip(ctx.step_nodes, counts, strict=True) if count > 1]
    if crowded or (ctx.step_tasks is not None and ctx.step_tasks > len(ctx.step_nodes)):
        node, count = crowded[0] if crowded else (ctx.step_nodes[0], ctx.step_tasks)
        raise LaunchError(
            f"srun started {count} zerorun launchers on node {node}, which would run the job {count} times "
            "(zerorun starts the workers itself: one launcher per node)",
            hint=f"write srun --ntasks-per-node=1 zerorun --nproc {count} ... (or run zerorun without srun "
                 "inside the allocation)",
        )
    if ctx.node_id is None or not 0 <= ctx.node_id < len(ctx.step_nodes):
        raise LaunchError(f"SLURM_NODEID={ctx.node_id} does not index the step's {len(ctx.step_nodes)} node(s)")
    return StepRole(ctx.step_nodes, ctx.node_id, ctx.step_nodes[0],
                    port if port is not None else master_port(ctx.job_id, ctx.step_id))


def threads_per_worker(ctx: SlurmContext | None, workers_on_node: int) -> int | None:
    """OMP_NUM_THREADS for each of a node's workers: the CPUs Slurm gave, shared out; None if unknown.

    In a step the CPUs are the launcher task's (``--cpus-per-task``); in the batch script or
    salloc shell they are the node's (SLURM_JOB_CPUS_PER_NODE), which the srun-started agents
    get whole.
    """
    if ctx is None or workers_on_node < 1:
        return None
    cpus = ctx.cpus_per_task or (None if ctx.in_step else ctx.cpus_on_node)
    if not cpus:
        return None
    return max(1, cpus // workers_on_node)


def gpus_problem(asked: int, environ: Mapping[str, str], visible_here) -> str | None:
    """``--gpus N`` against the allocation, before anything starts: the GPUs a node has for
    this job are SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE, else (on an allocated node: the
    batch script, a step) the GPUs ``visible_here()`` counts; unknown in a salloc shell on the
    submit host that names none. A sentence when ``asked`` is more, else None."""
    have = None
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        match = re.fullmatch(r"\s*(?:[\w.-]+:)?(\d+)\s*", environ.get(name) or "")
        if match:
            have, source = int(match.group(1)), name
            break
    if have is None and environ.get("SLURMD_NODENAME"):
        have, source = visible_here(), f"GPUs visible on {environ['SLURMD_NODENAME']}"
    if have is None or asked <= have:
        return None
    return f"--gpus {asked} asks for {asked} GPU(s) per node but the Slurm allocation has {have} ({source})"


def describe(ctx: SlurmContext | None, reach: Mapping[str, str] | None = None,
             port: int | None = None, signal_plan: Iterable[str] = ()) -> list[str]:
    """Lines for ``zerorun env`` and ``--dry-run``: the allocation, its nodes, how each is reached."""
    if ctx is None:
        return ["Slurm: not in an allocation (no SLURM_JOB_ID)"]
    lines = [f"Slurm: {ctx.where}; nodes {','.join(ctx.job_nodes) or '?'}"]
    if ctx.in_step:
        lines.append(f"  step nodes {','.join(ctx.step_nodes)}; this task: node {ctx.node_id}, "
                     f"task {ctx.proc_id} of {ctx.step_tasks}")
    if ctx.cpus_per_task or ctx.cpus_on_node:
        lines.append(f"  cpus per task {ctx.cpus_per_task or '-'}, cpus on node {ctx.cpus_on_node or '-'}")
    for host, how in (reach or {}).items():
        lines.append(f"  {host}: reached by {how}")
    if port is not None:
        lines.append(f"  rendezvous port {port}")
    lines += [f"  {line}" for line in signal_plan]
    return lines


# Note [why Slurm sent SIGTERM]: scancel, the time limit, preemption and a failed node all
# reach a job as SIGTERM; only the job's record tells them apart, and while the job still has
# live steps (the launcher is one) its JobState is COMPLETING whatever the cause. Measured on
# slurm-wlm 22.05 (tests/e2e/slurm_cluster.py), the record at the moment of the SIGTERM:
#
#   scancel                      JobState=COMPLETING Reason=None, Restarts unchanged
#   time limit                   JobState=COMPLETING Reason=TimeLimit
#   preemption, GraceTime > 0    JobState=RUNNING, PreemptTime set (the steps get SIGTERM,
#                                the batch script does not; the kill comes at PreemptTime+grace)
#   preemption, GraceTime 0      JobState=COMPLETING, Restarts one more than at our start
#                                (PreemptMode=REQUEUE: already requeued)
#   a node failure               JobState=NODE_FAIL (or Reason NodeDown/NodeFail); batch jobs
#                                are requeued by default, and then the record says only that
#                                (PENDING, Restarts one more), while ``scontrol show node``
#                                still lists the node DOWN (not responding): a job ended or
#                                requeued with one of its nodes down ended of a node failure
#                                (tests/e2e/test_slurm_node_failure.py freezes n2's slurmd)
#
# A SIGTERM while the record shows none of these (RUNNING, no PreemptTime) is a user's
# ``scancel --signal=TERM`` or a plain kill: the job is not being ended by Slurm.

STOP_CAUSES = ("preempted", "time limit", "node failure", "requeued", "cancelled")


def parse_job_record(text: str) -> dict[str, str]:
    """``scontrol -o show job`` output (one line of KEY=VALUE words) as a dict (pure)."""
    fields: dict[str, str] = {}
    for word in text.split():
        key, equals, value = word.partition("=")
        if equals and key and key not in fields:
            fields[key] = value
    return fields


def requeue_cause(sacct_states: Iterable[str]) -> str | None:
    """Why a requeued job's last run ended, from ``sacct -D -X -n -o State`` (every run of the
    job, oldest first; pure): a node set DOWN that came back at once leaves no down node to see
    and a record that says only "requeued", but accounting keeps NODE_FAIL for the
    run that ended. None otherwise: a preempted job that Slurm requeued stays "requeued" (Slurm
    did requeue it; the launcher must not requeue it again)."""
    ended = [state.strip().split()[0].upper() for state in sacct_states
             if state.strip() and state.strip().split()[0].upper() not in ("PENDING", "RUNNING", "REQUEUED")]
    if not ended:
        return None
    return "node failure" if ended[-1] == "NODE_FAIL" else None


def down_nodes(text: str) -> list[str]:
    """The nodes ``scontrol -o show node`` lists as down, failing or not responding (pure)."""
    found = []
    for line in text.splitlines():
        record = parse_job_record(line)
        state = record.get("State", "").upper()
        if record.get("NodeName") and (state.endswith("*") or any(
                word in state for word in ("DOWN", "FAIL", "NOT_RESPONDING"))):
            found.append(record["NodeName"])
    return found


def stop_cause(record: Mapping[str, str] | None, restarts_at_start: int = 0, *, end_time: int | None = None,
               now: float | None = None, down: Iterable[str] = ()) -> str | None:
    """Why Slurm is ending the job, from its record (Note [why Slurm sent SIGTERM]), pure: one of
    STOP_CAUSES, or None when the record says Slurm is not ending it (or there is no record and
    the time limit is not near). ``down``: the job's nodes Slurm has marked down; a job Slurm
    ends or requeues while one of its nodes is down ended because of it (a requeued job's record
    says only that it was requeued)."""
    if record is None:
        near_limit = end_time is not None and now is not None and now >= end_time - 10
        return "time limit" if near_limit else None
    state = record.get("JobState", "").upper()
    reason = record.get("Reason", "")
    if record.get("PreemptTime", "None") not in ("None", "", "Unknown", "N/A") or "PREEMPT" in state:
        return "preempted"
    if "TIMEOUT" in state or reason == "TimeLimit":
        return "time limit"
    if "NODE_FAIL" in state or reason in ("NodeDown", "NodeFail", "Node_Fail") or (
            any(down) and state not in ("RUNNING", "")):
        return "node failure"
    restarts = record.get("Restarts", "")
    if restarts.isdigit() and int(restarts) > restarts_at_start:
        return "requeued"
    if state in ("CANCELLED", "COMPLETING", "COMPLETED", "FAILED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"):
        return "cancelled"
    return None


def partition_grace(record: Mapping[str, str]) -> int | None:
    """A partition's preemption grace time in seconds (Note [preemption grace] in
    zerorun/worker/preemption_grace.py) from its ``scontrol -o show partition`` record (pure):
    None when it does not preempt by requeue or cancel, or gives no grace."""
    if record.get("PreemptMode", "OFF").upper().split(",")[0] not in ("REQUEUE", "CANCEL"):
        return None
    grace = record.get("GraceTime", "")
    return int(grace) if grace.isdigit() and int(grace) > 0 else None


def grace_note(partition: str, grace_s: int) -> str:
    """The start-up line naming the grace time a save on preemption must fit in (pure)."""
    return (f"Slurm: partition {partition} preempts with a {grace_s} s grace time; a save on preemption must "
            "finish within it (each checkpoint's save time is printed, and one that takes longer is named)")
