"""What Slurm's environment tells any zerorun process, launcher or worker (pure).

The launcher plans from it (zerorun/launch/slurm.py); a script started by ``srun python
train.py``, with no launcher, forms its world from it (``step_world``, called by
zerorun/zero/comm/process_group.py). Every function is a pure function of an environment
mapping or text, so unit tests fake any allocation without Slurm; malformed input raises
``HostfileError``/``LaunchError`` whose message names the variable.

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
from collections.abc import Mapping
from dataclasses import dataclass

from zerorun.errors import HostfileError, LaunchError

# A typo such as n[0-99999999999] must be one error line, not a MemoryError or the OOM killer.
MAX_HOSTS = 100_000
# The default rendezvous ports (Note [Slurm port]).
PORT_BASE = 20000
PORT_SPAN = 10000

# Hostnames, IPv4 and bracket-less IPv6 literals; anything else (spaces, quotes, shell
# metacharacters) is rejected early because the name ends up in an ssh command line.
_HOST_RE = re.compile(r"^[A-Za-z0-9_.:\-\[\]%]+$")


def check_host(name: str, where: str) -> str:
    if not name or not _HOST_RE.match(name) or name.startswith("-"):
        raise HostfileError(f"{where}: {name!r} is not a valid host name")
    return name


def expand_nodelist(nodelist: str, source: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expand Slurm's compressed node list: ``gpu[01-03,7],login1`` -> gpu01 gpu02 gpu03 gpu7 login1.

    Zero padding is kept (``n[08-10]`` -> n08 n09 n10) and a name may hold several bracket
    groups (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2), as in ``scontrol show hostnames``.
    """
    names: list[str] = []
    for item in _split_top_level(nodelist, source):
        for name in _expand_item(item, source, MAX_HOSTS - len(names)):
            names.append(check_host(name, source))
    if not names:
        raise HostfileError(f"{source} is empty")
    return names


def _expand_item(item: str, source: str, budget: int) -> list[str]:
    """One comma-free entry, first bracket group expanded, the rest recursively."""
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\](.*)", item)
    if match is None:
        if "[" in item or "]" in item:
            raise HostfileError(f"{source}: cannot parse {item!r}")
        return [item]
    prefix, ranges, rest = match.groups()
    heads: list[str] = []
    for part in ranges.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise HostfileError(f"{source}: bad range {part!r} in {item!r}")
        width = len(low)
        end = int(high) if dash else int(low)
        if end < int(low):
            raise HostfileError(f"{source}: range {part!r} runs backwards")
        if len(heads) + end - int(low) + 1 > budget:
            raise HostfileError(f"{source}: {item!r} names more than {MAX_HOSTS:,} nodes")
        heads += [f"{prefix}{n:0{width}d}" for n in range(int(low), end + 1)]
    tails = _expand_item(rest, source, max(1, budget // len(heads)))
    if len(heads) * len(tails) > budget:
        raise HostfileError(f"{source}: {item!r} names more than {MAX_HOSTS:,} nodes")
    return [head + tail for head in heads for tail in tails]


def _split_top_level(text: str, source: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, current = [], 0, ""
    for char in text.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostfileError(f"{source}: unbalanced ']' in {text!r}")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise HostfileError(f"{source}: unbalanced '[' in {text!r}")
    items.append(current)
    if any(not item for item in items):
        raise HostfileError(f"{source}: empty entry in {text!r}")
    return items


def expand_tasks_per_node(value: str, node_count: int) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE (``2(x3),1``) to one count per node."""
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise HostfileError(f"SLURM_TASKS_PER_NODE: cannot parse {part!r}")
        repeat = int(match.group(2) or 1)
        if len(counts) + repeat > node_count:
            raise HostfileError(f"SLURM_TASKS_PER_NODE gives more counts than the {node_count} nodes")
        counts += [int(match.group(1))] * repeat
    if len(counts) != node_count:
        raise HostfileError(f"SLURM_TASKS_PER_NODE gives {len(counts)} counts for {node_count} nodes")
    return counts


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


@dataclass(frozen=True)
class StepWorld:
    """The world of ``srun python train.py``: one rank per Slurm task."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


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
