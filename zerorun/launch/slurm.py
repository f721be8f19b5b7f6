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
  ``srun python train.py`` (no zerorun) forms its world from the same variables in
  ``zerorun.zero.comm.process_group``.

Note [Slurm port]: the launchers of one job on different nodes must agree on the rendezvous
port without talking to each other, and two jobs (or two steps of a job) sharing a node must
not collide. So the default port is a function of the job and step ids, in
``PORT_BASE .. PORT_BASE + PORT_SPAN - 1`` (20000-29999: below Linux's ephemeral range
32768-60999, so the kernel never hands it to an outgoing connection): ten ports per job id,
one per step id modulo 9 plus one for the batch script / salloc shell. Jobs whose ids differ
by a multiple of 1000 and run on one node at the same time could still meet; ``--master-port``
(or MASTER_PORT for ``srun python``) always wins.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from zerorun.errors import HostfileError, LaunchError
from zerorun.launch.hostfile import expand_nodelist, expand_tasks_per_node

PORT_BASE = 20000
PORT_SPAN = 10000
# The signals Slurm sends a job, and what each one means to the launcher (Note [Slurm signals]
# in launcher.py): SIGTERM on scancel, at the time limit and on preemption; the one chosen with
# --signal=[B:]SIG@SECONDS (USR1 by convention) shortly before the time limit.
SIGNAL_MEANINGS = {
    "SIGTERM": "cancelled (scancel), time limit or preemption",
    "SIGHUP": "the terminal or salloc session went away",
    "SIGUSR1": "time limit near (sbatch --signal=B:USR1@SECONDS)",
    "SIGUSR2": "time limit near (sbatch --signal=B:USR2@SECONDS)",
}


@dataclass(frozen=True)
class SlurmContext:
    """The Slurm variables a launcher or worker acts on, parsed and checked once."""

    job_id: int
    job_nodes: tuple[str, ...]
    # None in the batch script and the salloc shell (not inside a step).
    step_id: int | None = None
    step_nodes: tuple[str, ...] = ()
    step_tasks: int | None = None  # SLURM_STEP_NUM_TASKS (SLURM_NTASKS in a step)
    step_tasks_per_node: tuple[int, ...] = ()
    node_id: int | None = None  # SLURM_NODEID: this node's index in the step's node list
    proc_id: int | None = None  # SLURM_PROCID: this task's global index
    local_id: int | None = None  # SLURM_LOCALID: this task's index on its node
    ntasks: int | None = None  # SLURM_NTASKS of the allocation (batch script / salloc)
    cpus_per_task: int | None = None
    cpus_on_node: int | None = None  # first entry of SLURM_JOB_CPUS_PER_NODE
    node_name: str | None = None  # SLURMD_NODENAME: set on an allocated node (batch script, steps)
    end_time: int | None = None  # SLURM_JOB_END_TIME (Unix seconds), where Slurm sets it
    restart_count: int = 0  # SLURM_RESTART_COUNT: how often the job was requeued before this start
    array_task_id: int | None = None  # SLURM_ARRAY_TASK_ID in a job array

    @property
    def in_step(self) -> bool:
        return self.step_id is not None

    @property
    def where(self) -> str:
        """Which of the three places (Note [three Slurm places]) this is, in words."""
        if self.in_step:
            return f"step {self.job_id}.{self.step_id} (started by srun)"
        if self.node_name:
            return f"job {self.job_id}, batch script on {self.node_name}"
        return f"job {self.job_id}, allocation shell (salloc) on the submit host"


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            if not value.isdigit():
                raise HostfileError(f"{name}={value!r} is not a non-negative integer")
            return int(value)
    return None


def _first_count(value: str | None) -> int | None:
    """``4(x2),8`` -> 4: the first node's count of a Slurm per-node list."""
    match = re.match(r"\s*(\d+)", value or "")
    return int(match.group(1)) if match else None


def detect(environ: Mapping[str, str]) -> SlurmContext | None:
    """The Slurm allocation (and step) this process runs in, or None outside Slurm."""
    job_id = _int(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    if job_id is None:
        return None
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    job_nodes = tuple(expand_nodelist(nodelist, "SLURM_JOB_NODELIST")) if nodelist else ()
    step_id = _int(environ, "SLURM_STEP_ID", "SLURM_STEPID")
    if step_id is not None and step_id >= 0xFFFFFF00:
        step_id = None  # Slurm's special ids (batch 0xfffffffb, extern ...): not a user step
    step_nodes: tuple[str, ...] = ()
    step_tasks_per_node: tuple[int, ...] = ()
    if step_id is not None:
        step_list = environ.get("SLURM_STEP_NODELIST") or nodelist
        if not step_list:
            raise HostfileError("SLURM_STEP_ID is set but SLURM_STEP_NODELIST is not")
        step_nodes = tuple(expand_nodelist(step_list, "SLURM_STEP_NODELIST"))
        per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
        if per_node:
            step_tasks_per_node = tuple(expand_tasks_per_node(per_node, len(step_nodes)))
    return SlurmContext(
        job_id=job_id,
        job_nodes=job_nodes,
        step_id=step_id,
        step_nodes=step_nodes,
        step_tasks=_int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if step_id is not None else None,
        step_tasks_per_node=step_tasks_per_node,
        node_id=_int(environ, "SLURM_NODEID"),
        proc_id=_int(environ, "SLURM_PROCID"),
        local_id=_int(environ, "SLURM_LOCALID"),
        ntasks=_int(environ, "SLURM_NTASKS", "SLURM_NPROCS"),
        cpus_per_task=_int(environ, "SLURM_CPUS_PER_TASK"),
        cpus_on_node=_first_count(environ.get("SLURM_JOB_CPUS_PER_NODE")) or _int(environ, "SLURM_CPUS_ON_NODE"),
        node_name=environ.get("SLURMD_NODENAME") or None,
        end_time=_int(environ, "SLURM_JOB_END_TIME"),
        restart_count=_int(environ, "SLURM_RESTART_COUNT") or 0,
        array_task_id=_int(environ, "SLURM_ARRAY_TASK_ID"),
    )


def master_port(job_id: int, step_id: int | None) -> int:
    """The default rendezvous port of a job's step (Note [Slurm port])."""
    slot = 0 if step_id is None else 1 + step_id % 9
    return PORT_BASE + (job_id % (PORT_SPAN // 10)) * 10 + slot


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


@dataclass(frozen=True)
class StepWorld:
    """The world of ``srun python train.py``: one rank per Slurm task."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


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


def step_world(environ: Mapping[str, str]) -> StepWorld | None:
    """Rank, world and rendezvous from a Slurm step for a script started by ``srun`` directly.

    None where Slurm says there is one task (or no Slurm at all). Raises LaunchError where Slurm
    says there are several tasks but the world cannot be formed: never a silent world of 1.
    """
    ctx = detect(environ)
    if ctx is None:
        return None
    if not ctx.in_step:
        if ctx.ntasks and ctx.ntasks > 1 and ctx.node_name:
            raise LaunchError(
                f"Slurm gives this job {ctx.ntasks} tasks, but this process was not started by srun "
                "(it is the batch script), so it would train alone",
                hint="start it with srun python train.py, or zerorun train.py",
            )
        return None
    tasks = ctx.step_tasks or 1
    if tasks == 1:
        return None
    proc_id, local_id = ctx.proc_id, ctx.local_id
    if proc_id is None or local_id is None:
        missing = [name for name, value in (("SLURM_PROCID", proc_id), ("SLURM_LOCALID", local_id))
                   if value is None]
        raise LaunchError(f"SLURM_STEP_NUM_TASKS={tasks} but {' and '.join(missing)} not set: cannot form the world")
    if proc_id >= tasks:
        raise LaunchError(f"SLURM_PROCID={proc_id} is not below SLURM_STEP_NUM_TASKS={tasks}")
    port = _int(environ, "MASTER_PORT") or master_port(ctx.job_id, ctx.step_id)
    addr = environ.get("MASTER_ADDR") or ctx.step_nodes[0]
    return StepWorld(proc_id, tasks, local_id, addr, port)


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
#   a node failure               JobState=NODE_FAIL (or Reason NodeDown/NodeFail)
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


def stop_cause(record: Mapping[str, str] | None, restarts_at_start: int = 0, *, end_time: int | None = None,
               now: float | None = None) -> str | None:
    """Why Slurm is ending the job, from its record (Note [why Slurm sent SIGTERM]), pure: one of
    STOP_CAUSES, or None when the record says Slurm is not ending it (or there is no record and
    the time limit is not near)."""
    if record is None:
        near_limit = end_time is not None and now is not None and now >= end_time - 10
        return "time limit" if near_limit else None
    state = record.get("JobState", "").upper()
    reason = record.get("Reason", "")
    if record.get("PreemptTime", "None") not in ("None", "", "Unknown", "N/A") or "PREEMPT" in state:
        return "preempted"
    if "TIMEOUT" in state or reason == "TimeLimit":
        return "time limit"
    if "NODE_FAIL" in state or reason in ("NodeDown", "NodeFail", "Node_Fail"):
        return "node failure"
    restarts = record.get("Restarts", "")
    if restarts.isdigit() and int(restarts) > restarts_at_start:
        return "requeued"
    if state in ("CANCELLED", "COMPLETING", "COMPLETED", "FAILED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"):
        return "cancelled"
    return None
