"""The launch plan: which rank runs where, with which environment and argv (pure data).

``build_plan`` is a pure function of the chosen host slots and the job's settings; the
supervisor only executes what it says, and ``--dry-run`` prints it (``describe_plan``).
Ranks are numbered host by host in hostfile order, local ranks in slot order, exactly as
torchrun and DeepSpeed do, so scripts written for them see the same numbering.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from zerorun.errors import LaunchError
from zerorun.launch.device import ENV_NAME as DEVICE_ENV
from zerorun.launch.device import device_for_worker
from zerorun.launch.hostfile import HostSlots
from zerorun.worker.launch_env import HOST_SLOTS_ENV

# Hosts that always mean "this machine": never reached over ssh.
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class Target:
    """What each worker runs: ``python SCRIPT ARGS`` or ``python -m MODULE ARGS``."""

    script: str | None = None
    module: str | None = None
    args: tuple[str, ...] = ()
    # DeepSpeed's launcher appends --local_rank=N to every worker's arguments; scripts written
    # for it read that (zerorun --local-rank-arg, docs/deepspeed.md).
    local_rank_arg: bool = False

    def __post_init__(self):
        if (self.script is None) == (self.module is None):
            raise LaunchError("give either a script or -m MODULE (exactly one)")

    def argv(self, python: str, local_rank: int = 0) -> list[str]:
        # -u: unbuffered, so output and tracebacks reach the launcher line by line.
        head = ["-m", self.module] if self.module else [self.script]
        tail = [f"--local_rank={local_rank}"] if self.local_rank_arg else []
        return [python, "-u", *head, *self.args, *tail]


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    local_rank: int
    host: str
    node_rank: int
    argv: list[str]
    env: dict[str, str]


# How the launcher reaches a node's agent: a child process here, over ssh, or as a Slurm step.
REACHES = ("local", "ssh", "srun")


@dataclass(frozen=True)
class NodeSpec:
    host: str
    node_rank: int
    local: bool
    workers: list[WorkerSpec]
    reach: str = "ssh"  # one of REACHES; "local" exactly when ``local``


@dataclass(frozen=True)
class LaunchPlan:
    nodes: list[NodeSpec]
    world_size: int
    master_addr: str
    master_port: int
    run_dir: str
    cwd: str
    python: str
    target: Target
    # Extra variables every worker on every host gets (prefix-forwarded env + env file).
    forwarded_env: dict[str, str] = field(default_factory=dict)

    @property
    def workers(self) -> list[WorkerSpec]:
        return [worker for node in self.nodes for worker in node.workers]

    @property
    def remote_nodes(self) -> list[NodeSpec]:
        return [node for node in self.nodes if not node.local]


def is_local_host(host: str, local_names: frozenset[str] | set[str] = frozenset()) -> bool:
    return host in LOCAL_NAMES or host in local_names


def default_master_addr(hosts: list[str], local_names, this_host_name: str) -> str:
    """The first host runs rank 0, so it hosts the rendezvous (as in DeepSpeed).

    A loopback *name* for it means nothing to another machine: when other hosts take part,
    "localhost"/"::1" is replaced by this machine's own name.
    """
    first = hosts[0]
    any_remote = any(not is_local_host(host, local_names) for host in hosts)
    if not any_remote:
        return "127.0.0.1" if first in LOCAL_NAMES else first
    return this_host_name if first in ("localhost", "::1") else first


def worker_threads(slurm_share: int | None, device_kind: str | None, local: bool, host_cpus: int | None,
                   workers_on_host: int) -> int | None:
    """OMP_NUM_THREADS for a host's workers where the user set none (pure); None leaves torch's
    default (every core), for a host's only worker.

    Note [worker threads]: Slurm's CPUs, shared out, when Slurm says (``slurm_share``). Else,
    for GPU workers (``--gpus``) on this machine, the machine's usable cores shared out: their
    compute is on the GPU, and what runs on the host is the optimizer of ``offload_optimizer:
    cpu`` (torch's fused CPU AdamW: 5.5 G params/s on 16 threads, about a sixteenth of that on
    one), which torchrun's rule below left one core per rank of an otherwise idle node. Else
    torchrun's rule: one thread each when a host runs several workers (CPU workers computing on
    every core at once thrash; a remote host's cores are not known here)."""
    if slurm_share is not None:
        return slurm_share
    if device_kind == "cuda" and local and host_cpus:
        return max(1, host_cpus // max(1, workers_on_host)) if workers_on_host > 1 else None
    return 1 if workers_on_host > 1 else None


def build_plan(
    hosts: HostSlots,
    target: Target,
    *,
    python: str,
    cwd: str,
    run_dir: str,
    token: str,
    master_port: int,
    master_addr: str | None = None,
    local_names: frozenset[str] | set[str] = frozenset(),
    set_visible_devices: bool = False,
    forwarded_env: dict[str, str] | None = None,
    inherited_env: dict[str, str] | None = None,
    this_host_name: str = "localhost",
    device_kind: str | None = None,
    remote_reach: str = "ssh",
    threads_per_worker: int | None = None,
    host_cpus: int | None = None,
) -> LaunchPlan:
    """Number ranks and compute every worker's environment.

    ``set_visible_devices``: when a filter picked a subset of a host's GPUs, pin the worker's
    CUDA_VISIBLE_DEVICES to exactly those slots so LOCAL_RANK indexes them (DeepSpeed does the
    same). ``inherited_env`` is only consulted for variables we set only when the user has not
    (OMP_NUM_THREADS). ``device_kind``: "cpu" (--nproc) or "cuda" (--gpus) sets each worker's
    ZERORUN_DEVICE (Note [device contract] in device.py); None leaves the choice to the worker.
    ``remote_reach``: how hosts other than this one are reached ("ssh" or "srun").
    ``threads_per_worker``: OMP_NUM_THREADS where the user set none (the CPUs Slurm gave a
    node shared among its workers); None keeps torchrun's rule (1 when a host runs several).
    ``host_cpus``: the cores this machine lets the job use, shared among its GPU workers
    (Note [worker threads]).
    """
    if remote_reach not in REACHES[1:]:
        raise LaunchError(f"remote hosts are reached by ssh or srun, not {remote_reach!r}")
    if not hosts:
        raise LaunchError("no hosts to run on")
    if not 0 < master_port < 65536:
        raise LaunchError(f"--master-port must be in 1..65535, got {master_port}")
    inherited_env = inherited_env or {}
    world_size = sum(len(slots) for slots in hosts.values())
    if master_addr is None:
        master_addr = default_master_addr(list(hosts), local_names, this_host_name)
    nodes: list[NodeSpec] = []
    host_slots = ",".join(str(len(slots)) for slots in hosts.values())  # Note [link classes]
    rank = 0
    for node_rank, (host, slots) in enumerate(hosts.items()):
        workers = []
        for local_rank, _slot in enumerate(slots):
            env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(len(slots)),
                "GROUP_RANK": str(node_rank),
                "NODE_RANK": str(node_rank),
                "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "ZERORUN_CONFIG": f"{run_dir}/config.json",
                "ZERORUN_RUN_DIR": run_dir,
                "ZERORUN_RUN_TOKEN": token,
                "ZERORUN_HOST": host,
                HOST_SLOTS_ENV: host_slots,
                "PYTHONUNBUFFERED": "1",
                # Stacks on SIGABRT: what the launcher shows for a hung job (Note [hang timeout]).
                "PYTHONFAULTHANDLER": "1",
                # Note [any script is visible]: telemetry from the worker's first moment.
                "PYTHONPATH": worker_pythonpath(forwarded_env, inherited_env),
            }
            user_set_threads = "OMP_NUM_THREADS" in inherited_env or "OMP_NUM_THREADS" in (forwarded_env or {})
            threads = worker_threads(threads_per_worker, device_kind, is_local_host(host, local_names), host_cpus,
                                     len(slots))
            if threads is not None and not user_set_threads:
                env["OMP_NUM_THREADS"] = str(threads)
            device = device_for_worker(device_kind, local_rank)
            if device is not None:
                env[DEVICE_ENV] = device
            if set_visible_devices:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in slots)
            workers.append(WorkerSpec(rank, local_rank, host, node_rank, target.argv(python, local_rank), env))
            rank += 1
        local = is_local_host(host, local_names)
        nodes.append(NodeSpec(host, node_rank, local, workers, "local" if local else remote_reach))
    return LaunchPlan(
        nodes=nodes,
        world_size=world_size,
        master_addr=master_addr,
        master_port=master_port,
        run_dir=run_dir,
        cwd=cwd,
        python=python,
        target=target,
        forwarded_env=dict(forwarded_env or {}),
    )


SECRET_KEYS = ("ZERORUN_RUN_TOKEN",)

# Note [any script is visible] (zerorun/worker/boot/sitecustomize.py): first on every worker's
# PYTHONPATH, it starts the worker's telemetry before the script runs, so a script that never
# calls zerorun.initialize still shows its memory. A remote host whose zerorun lives elsewhere
# finds no such folder and goes without (its workers report from initialize on, as before).
BOOT_DIR = str(Path(__file__).resolve().parents[1] / "worker" / "boot")


def worker_pythonpath(forwarded_env: dict[str, str] | None, inherited_env: dict[str, str] | None) -> str:
    """BOOT_DIR, then the PYTHONPATH the worker would have had (forwarded, else inherited)."""
    rest = (forwarded_env or {}).get("PYTHONPATH") or (inherited_env or {}).get("PYTHONPATH") or ""
    return BOOT_DIR + (os.pathsep + rest if rest else "")


def plan_to_dict(plan: LaunchPlan, *, hide_secrets: bool = True) -> dict:
    data = asdict(plan)
    if hide_secrets:
        for node in data["nodes"]:
            for worker in node["workers"]:
                for key in SECRET_KEYS:
                    if key in worker["env"]:
                        worker["env"][key] = "***"
    return data


def describe_plan(plan: LaunchPlan, node_commands: dict[str, list[str]]) -> str:
    """Human-readable plan for --dry-run: hosts, ranks, env and the command each host runs."""
    lines = [
        f"world size {plan.world_size} on {len(plan.nodes)} host(s); "
        f"master {plan.master_addr}:{plan.master_port}; run dir {plan.run_dir}",
        f"working directory {plan.cwd}",
    ]
    if plan.forwarded_env:
        lines.append("forwarded env: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(plan.forwarded_env.items())))
    for node in plan.nodes:
        where = node.reach
        lines.append(f"host {node.host} (node {node.node_rank}, {where}, {len(node.workers)} worker(s))")
        lines.append("  agent: " + shlex.join(node_commands.get(node.host, ["(none)"])))
        for worker in node.workers:
            env = {k: ("***" if k in SECRET_KEYS else shlex.quote(v)) for k, v in worker.env.items()}
            lines.append(f"  rank {worker.rank} (local {worker.local_rank}): " + shlex.join(worker.argv))
            lines.append("    env " + " ".join(f"{k}={v}" for k, v in env.items()))
    return "\n".join(lines)


def plan_json(plan: LaunchPlan) -> str:
    return json.dumps(plan_to_dict(plan), indent=2)
