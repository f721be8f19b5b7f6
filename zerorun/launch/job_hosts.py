"""Which launcher and which hosts (options -> hosts): how the job is started ("local", "ssh",
"srun" or "step") and each host's worker slots, from --hostfile, Slurm or this machine.

Everything here refuses bad input with one line (LaunchError) before anything starts; the
only effects are reading the hostfile and asking this machine about its GPUs and names.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

from zerorun.config.sources import read_small_file
from zerorun.errors import HostfileError, LaunchError
from zerorun.launch import slurm
from zerorun.launch.hostfile import MAX_SLOTS_PER_HOST, HostSlots, parse_hostfile, select_hosts, slurm_hosts
from zerorun.launch.plan import is_local_host
from zerorun.launch.slurm import StepRole

if TYPE_CHECKING:
    from zerorun.launch.prepare import LaunchOptions

# --- which launcher -------------------------------------------------------------------------

LAUNCHERS = ("ssh", "slurm", "local")


def choose_launcher(requested: str | None, ctx: slurm.SlurmContext | None, hostfile: bool) -> str:
    """How the job is launched (pure): "local", "ssh" (hostfile or Slurm nodes over ssh),
    "srun" (in an allocation: one srun step per node) or "step" (this launcher is one task of
    an ``srun ... zerorun`` step and runs its own node's workers)."""
    if requested is not None and requested not in LAUNCHERS:
        raise LaunchError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {requested!r}")
    if requested == "local":
        return "local"
    if requested == "slurm":
        if ctx is None:
            raise LaunchError("--launcher slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set)",
                              hint="run it under salloc or sbatch, or as srun --ntasks-per-node=1 zerorun ...")
        if hostfile:
            raise LaunchError("--launcher slurm takes its nodes from the allocation; drop --hostfile")
        return "step" if ctx.in_step else "srun"
    if requested == "ssh" and ctx is not None and ctx.in_step and not hostfile:
        raise LaunchError("--launcher ssh inside an srun step would start the whole job from every task",
                          hint="run zerorun --launcher ssh in the batch script or salloc shell instead")
    if requested == "ssh" or hostfile or ctx is None or not ctx.job_nodes:
        return "ssh"
    return "step" if ctx.in_step else "srun"


# --- hosts ----------------------------------------------------------------------------------


def count_gpus() -> int:
    """GPUs this process can see (CUDA_VISIBLE_DEVICES honoured); torch imported only here."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def has_nvidia_gpu() -> bool:
    """Whether the NVIDIA driver lists a GPU here, without importing torch (only for a note)."""
    try:
        return bool(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return False


def resolve_hosts(options: LaunchOptions, environ: Mapping[str, str], gpu_counter=count_gpus,
                  use_slurm: bool = True) -> HostSlots:
    """Hosts and slot ids from --hostfile, else Slurm (unless ``use_slurm`` is off), else this
    machine (--nproc/--gpus). Under Slurm a task is a launcher, not a worker: --nproc/--gpus N
    gives every node N workers, whatever the tasks per node."""
    per_host = _workers_per_host(options)
    on_this_machine = False
    if options.hostfile:
        text = read_small_file(options.hostfile, "hostfile", HostfileError)
        hosts = parse_hostfile(text, source=options.hostfile)
    else:
        slurm_nodes = slurm_hosts(environ) if use_slurm else None
        if slurm_nodes is not None:
            hosts = slurm_nodes if per_host is None else {host: per_host for host in slurm_nodes}
        else:
            if options.gpus is not None:
                available = gpu_counter()
                if options.gpus > available:
                    visible = environ.get("CUDA_VISIBLE_DEVICES")
                    where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
                    raise LaunchError(
                        f"--gpus {options.gpus} asks for {options.gpus} GPU(s) but this machine has {available} visible{where}",
                        hint="use --nproc N to run N CPU workers with gloo",
                    )
            hosts = {"localhost": per_host or 1}
            on_this_machine = True
    chosen = select_hosts(hosts, options.include, options.exclude, options.num_nodes)
    if per_host is not None and not on_this_machine:
        # With a host list, --nproc/--gpus caps the workers per host (DeepSpeed's --num_gpus).
        for host, slots in chosen.items():
            if per_host > len(slots):
                raise LaunchError(f"{per_host} workers per host asked for, but {host} has only {len(slots)} slot(s)")
        chosen = {host: slots[:per_host] for host, slots in chosen.items()}
    return chosen


def _workers_per_host(options: LaunchOptions) -> int | None:
    """--gpus or --nproc, checked; None when neither is given."""
    if options.nproc is not None and options.gpus is not None:
        raise LaunchError("--nproc and --gpus cannot be used together", hint="--gpus N for GPU workers, --nproc N for CPU workers")
    for flag, value in (("--nproc", options.nproc), ("--gpus", options.gpus)):
        if value is not None and value < 1:
            raise LaunchError(f"{flag} must be at least 1, got {value}")
        if value is not None and value > MAX_SLOTS_PER_HOST:
            raise LaunchError(f"{flag} {value} is more than {MAX_SLOTS_PER_HOST} workers on one host")
    return options.gpus or options.nproc


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class JobHosts(NamedTuple):
    hosts: HostSlots  # every host with its worker slots
    role: StepRole | None  # this node's role in an srun step, else None
    step_label: str  # "slurm-JOB.STEP" in an srun step, else ""
    local_names: set[str]  # the names this machine answers to


def job_hosts(options: LaunchOptions, environ: Mapping[str, str], context, mode: str, gpu_counter) -> JobHosts:
    """The job's hosts and this node's part in them, refusing what cannot start (GPUs Slurm did
    not grant, no srun)."""
    if options.gpus is not None and context is not None and mode in ("srun", "step"):
        problem = slurm.gpus_problem(options.gpus, environ, gpu_counter)
        if problem:
            raise LaunchError(problem, hint="ask Slurm for them (--gpus-per-node=N or --gres=gpu:N), "
                                            "or use --nproc N for CPU workers")
    role = None
    step_label = ""
    if mode == "step":
        if context is None:  # choose_launcher picks "step" only inside a Slurm step
            raise LaunchError("not inside a Slurm step (SLURM_JOB_ID is not set)")
        hosts, role = step_hosts(options, environ, context)
        step_label = f"slurm-{context.job_id}.{context.step_id}"
    else:
        hosts = resolve_hosts(options, environ, gpu_counter, use_slurm=mode != "local")
    local_names = {socket.gethostname()}
    if context is not None:
        # getfqdn may ask DNS, so only where node lists may use another spelling of this host.
        local_names |= slurm.local_names(environ, socket.gethostname(), socket.getfqdn())
    if role is not None:
        local_names.add(role.host)
    remote = [host for host in hosts if not is_local_host(host, local_names)]
    if mode == "srun" and remote and shutil.which("srun") is None:
        raise LaunchError("inside a Slurm allocation but srun is not on PATH: cannot start the other nodes",
                          hint="module load slurm (or add srun to PATH), or --launcher ssh")
    return JobHosts(hosts, role, step_label, local_names)


def step_hosts(options: LaunchOptions, environ: Mapping[str, str], ctx: slurm.SlurmContext):
    """Every node of the srun step with its worker slots, and this launcher's role in it."""
    role = slurm.step_role(ctx, options.master_port)
    for flag, value in (("--hostfile", options.hostfile), ("--include", options.include),
                        ("--exclude", options.exclude), ("--num-nodes", options.num_nodes)):
        if value is not None:
            raise LaunchError(f"{flag} does not apply under srun: the step's nodes are the job's",
                              hint="choose the nodes with srun -N/-w")
    if options.nproc is not None and options.gpus is not None:
        raise LaunchError("--nproc and --gpus cannot be used together", hint="--gpus N for GPU workers, --nproc N for CPU workers")
    per_node = options.gpus or options.nproc
    if per_node is None:
        gpus = environ.get("SLURM_GPUS_ON_NODE", "")
        per_node = int(gpus) if gpus.isdigit() and int(gpus) > 0 else 1
    if not 1 <= per_node <= MAX_SLOTS_PER_HOST:
        raise LaunchError(f"{per_node} workers per node is not in 1..{MAX_SLOTS_PER_HOST}")
    return {node: list(range(per_node)) for node in role.nodes}, role
