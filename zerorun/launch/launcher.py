"""The launcher as a chain of values: options -> hosts -> plan -> config -> pre-flight -> run.

``prepare`` does everything that can fail on bad input, without starting anything (so
``--dry-run`` and real runs share it); ``execute`` starts the job and supervises it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from zerorun.errors import HostfileError, LaunchError
from zerorun.launch import slurm
from zerorun.launch.slurm import StepRole
from zerorun.worker import preemption_grace
from zerorun.worker.save_on_signal import ENV_NAME as SAVE_ON_SIGNAL_ENV
from zerorun.launch.commands import forwarded_env, node_agent_command, parse_env_file, parse_ssh_opts
from zerorun.config.sources import read_small_file
from zerorun.launch.hostfile import MAX_SLOTS_PER_HOST, HostSlots, parse_hostfile, select_hosts, slurm_hosts
from zerorun.launch.plan import LaunchPlan, Target, build_plan, describe_plan, is_local_host, plan_json

DEFAULT_MASTER_PORT = 29500
DEFAULT_ENV_FILE = ".zerorun.env"


@dataclass
class LaunchOptions:
    target: Target
    nproc: int | None = None
    gpus: int | None = None
    hostfile: str | None = None
    include: str | None = None
    exclude: str | None = None
    num_nodes: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    ssh_port: int | None = None
    ssh_options: list[str] = field(default_factory=list)
    env_file: str | None = None
    config: str | None = None
    # Dotted config keys from --set KEY=VALUE: they win over the environment and the file.
    config_overrides: dict = field(default_factory=dict)
    run_dir: str | None = None
    dashboard: bool = True
    grace_s: float = 3.0
    # --launcher ssh|slurm|local; None picks slurm inside an allocation (choose_launcher).
    launcher: str | None = None
    # --as-deepspeed: workers import zerorun.deepspeed as `deepspeed` (zerorun/deepspeed/as_deepspeed.py).
    as_deepspeed: bool = False


@dataclass
class PreparedJob:
    plan: LaunchPlan
    token: str
    config_json: str
    options: LaunchOptions
    ssh_options: list[str]
    # What the config loader accepted without effect (DeepSpeed keys we ignore, "auto" values).
    notes: list[str] = field(default_factory=list)
    # Seconds without progress before the job is ended as hung (0: never); Note [hang timeout].
    hang_timeout_s: float = 0.0
    # A quiet spell this long gets one warning line (telemetry.hang_after_s / ZERORUN_HANG_AFTER_S).
    hang_warn_s: float = 0.0
    # Seconds a rank may take to join the rendezvous (0: no limit); Note [start-up is not a hang].
    startup_timeout_s: float = 0.0
    # The Slurm allocation found (None outside one) and how the job is launched (choose_launcher).
    slurm: slurm.SlurmContext | None = None
    mode: str = "ssh"
    # checkpoint.on_signal / checkpoint.requeue (Note [Slurm signals]).
    save_on_signal: bool = False
    requeue: bool = False
    # This launcher's node of an ``srun ... zerorun`` step (mode "step"), else None.
    step_role: StepRole | None = None

    def node_commands(self) -> dict[str, list[str]]:
        """The agent command each host runs (what --dry-run shows; the supervisor builds the same)."""
        return {
            node.host: node_agent_command(node.reach, node.host, self.plan.cwd, self.plan.python,
                                          self.plan.forwarded_env, ssh_port=self.options.ssh_port,
                                          ssh_options=self.ssh_options)
            for node in self.plan.nodes
        }


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
    if options.nproc is not None and options.gpus is not None:
        raise LaunchError("--nproc and --gpus cannot be used together", hint="--gpus N for GPU workers, --nproc N for CPU workers")
    for flag, value in (("--nproc", options.nproc), ("--gpus", options.gpus)):
        if value is not None and value < 1:
            raise LaunchError(f"{flag} must be at least 1, got {value}")
        if value is not None and value > MAX_SLOTS_PER_HOST:
            raise LaunchError(f"{flag} {value} is more than {MAX_SLOTS_PER_HOST} workers on one host")
    per_host = options.gpus or options.nproc
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def default_run_dir(cwd: str, ctx: slurm.SlurmContext | None = None) -> str:
    """``zerorun-runs/<time>-<id>``; in a Slurm job ``zerorun-runs/slurm-JOB`` (``-arrayTASK`` in a
    job array), which a requeued start (SLURM_RESTART_COUNT > 0) continues: one run directory and
    one metrics file per job, however often it is requeued. A second launch in the same
    allocation (a salloc shell) gets its own time-stamped folder beside it."""
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    if ctx is None:
        return str(Path(cwd) / "zerorun-runs" / stamp)
    name = f"slurm-{ctx.job_id}" + (f"-array{ctx.array_task_id}" if ctx.array_task_id is not None else "")
    path = Path(cwd) / "zerorun-runs" / name
    if ctx.restart_count > 0 or not path.exists():
        return str(path)
    return str(Path(cwd) / "zerorun-runs" / f"{name}-{stamp}")


# --- prepare / execute --------------------------------------------------------------------


def prepare(options: LaunchOptions, environ: Mapping[str, str] | None = None, cwd: str | None = None,
            gpu_counter=count_gpus) -> PreparedJob:
    """Validate everything and build the plan; starts nothing, writes nothing.

    A chain of values: options -> hosts (and this node's role under srun) -> plan -> config ->
    the job, each step its own function below."""
    environ = dict(os.environ if environ is None else environ)
    cwd = os.path.abspath(cwd or os.getcwd())
    target = options.target
    if target.script is not None and not os.path.isfile(os.path.join(cwd, target.script)):
        # Checked here as well as in pre-flight so --dry-run catches it too.
        raise LaunchError(f"script {target.script} not found (looked in {cwd})")
    context = slurm.detect(environ)
    mode = choose_launcher(options.launcher, context, bool(options.hostfile))
    hosts, role, step_label, local_names = _job_hosts(options, environ, context, mode, gpu_counter)
    env_file_vars = {}
    env_file = options.env_file or (DEFAULT_ENV_FILE if os.path.isfile(os.path.join(cwd, DEFAULT_ENV_FILE)) else None)
    if env_file:
        text = read_small_file(Path(cwd) / env_file, "env file", LaunchError)
        env_file_vars = parse_env_file(text, source=env_file)
    from zerorun.zero.comm.shm_names import channel_wanted

    channel_wanted({**environ, **env_file_vars})  # ZERORUN_HOST_CHANNEL: every rank would refuse it after start
    ssh_options = parse_ssh_opts(environ.get("ZERORUN_SSH_OPTS", "")) + list(options.ssh_options)
    token = secrets.token_hex(16)
    all_local = all(is_local_host(h, local_names) for h in hosts)
    plan = build_plan(
        hosts,
        target,
        python=sys.executable,
        cwd=cwd,
        run_dir=_run_dir(options, cwd, role, step_label, context if mode != "local" else None),
        token=token,
        master_port=_master_port(options, role, next(iter(hosts)), local_names, context, mode),
        master_addr=options.master_addr or (role.master_addr if role is not None else None),
        local_names=local_names,
        set_visible_devices=any(":" in (f or "") for f in (options.include, options.exclude)),
        forwarded_env=env_file_vars if all_local else forwarded_env(environ, env_file_vars),
        inherited_env=environ,
        this_host_name=socket.gethostname(),
        device_kind="cpu" if options.nproc is not None else "cuda" if options.gpus is not None else None,
        remote_reach="srun" if mode == "srun" else "ssh",
        threads_per_worker=slurm.threads_per_worker(context, max(len(slots) for slots in hosts.values())),
    )
    if role is not None:
        # The plan numbers every node's ranks; this launcher runs only its own node's.
        plan = dataclasses.replace(plan, nodes=[node for node in plan.nodes if node.node_rank == role.node_rank])
    config, notes = _job_config(options, cwd, plan.world_size, environ, all_local)
    notes += _worker_env_for_options(plan, options, config, environ)
    from zerorun.config import to_dict

    return PreparedJob(plan, token, json.dumps(to_dict(config), indent=2), options, ssh_options, notes=notes,
                       hang_timeout_s=config.telemetry.hang_timeout_s,
                       hang_warn_s=hang_warning_after(environ, config.telemetry.hang_after_s),
                       slurm=context, mode=mode, save_on_signal=config.checkpoint.on_signal,
                       requeue=config.checkpoint.requeue,
                       startup_timeout_s=config.telemetry.startup_timeout_s, step_role=role)


def _job_hosts(options: LaunchOptions, environ: Mapping[str, str], context, mode: str, gpu_counter):
    """(hosts with their slots, this node's role in an srun step or None, the step's label, the
    names this machine answers to), refusing what cannot start (GPUs Slurm did not grant, no srun)."""
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
    return hosts, role, step_label, local_names


def _master_port(options: LaunchOptions, role, first_host: str, local_names, context, mode: str) -> int:
    if role is not None:
        return role.master_port  # every node's launcher computes the same (Note [Slurm port])
    if options.master_port is not None:
        return options.master_port
    # A free port when the master is this machine (parallel jobs do not collide); under Slurm one
    # derived from the job id (Note [Slurm port]); torchrun's default otherwise, since we cannot
    # probe another machine's ports.
    if is_local_host(first_host, local_names):
        return free_port()
    return slurm.master_port(context.job_id, None) if context is not None and mode != "local" else DEFAULT_MASTER_PORT


def _run_dir(options: LaunchOptions, cwd: str, role, step_label: str,
             slurm_job: slurm.SlurmContext | None) -> str:
    if role is not None:
        # One folder per node of the step (several launchers may share a filesystem).
        base = options.run_dir or os.path.join(cwd, "zerorun-runs", step_label)
        return os.path.abspath(os.path.join(base, f"node{role.node_rank}"))
    return os.path.abspath(options.run_dir or default_run_dir(cwd, slurm_job))


def _job_config(options: LaunchOptions, cwd: str, world_size: int, environ: Mapping[str, str], all_local: bool):
    """The validated config (--config, else ./zerorun.yaml, then environment and --set) and the
    notes to print about it."""
    from zerorun.config import load_config
    from zerorun.config.sources import launcher_config_file

    config_source, config_note = launcher_config_file(options.config, cwd)
    config = load_config(
        config_source, world_size=world_size, overrides=options.config_overrides or None, environ=environ,
        torch_in_child=True,
    )
    notes = ([config_note] if config_note else []) + list(config.notes)
    if all_local:
        notes += nvme_path_notes(config, cwd)
    if options.nproc is not None and has_nvidia_gpu():
        notes.append(f"--nproc {options.nproc} runs CPU workers (gloo, ZERORUN_DEVICE=cpu) although this "
                     "machine has GPUs; use --gpus N for GPU workers")
    return config, notes


def _worker_env_for_options(plan: LaunchPlan, options: LaunchOptions, config, environ: Mapping[str, str]) -> list[str]:
    """What --as-deepspeed and checkpoint.on_signal add to every worker's environment; notes to print."""
    notes = []
    if options.as_deepspeed:
        from zerorun.deepspeed.as_deepspeed import shadowed_deepspeed, worker_env

        for worker in plan.workers:
            worker.env.update(worker_env({**environ, **plan.forwarded_env}))
        real = shadowed_deepspeed()
        notes.append("--as-deepspeed: the workers' `import deepspeed` is zerorun.deepspeed"
                     + (f"; the installed {real} is not used by this job" if real else ""))
    if config.checkpoint.on_signal:
        for worker in plan.workers:
            worker.env[SAVE_ON_SIGNAL_ENV] = "1"
        grace = slurm.read_partition_grace(environ)  # Note [preemption grace]
        if grace is not None:
            for worker in plan.workers:
                worker.env[preemption_grace.GRACE_ENV] = str(grace[1])
            notes.append(slurm.grace_note(*grace))
    return notes


def nvme_path_notes(config, cwd: str) -> list[str]:
    """Refuse an NVMe path this machine cannot use before any worker starts (ConfigError); the
    notes say which path zerorun will create. Remote hosts' paths are their engines' to check."""
    from zerorun.errors import ConfigError
    from zerorun.zero.offload.scratch import nvme_path_problem

    notes = []
    for key in ("offload_optimizer", "offload_param"):
        offload = getattr(config.zero, key)
        if offload.device != "nvme" or not offload.nvme_path:
            continue
        path = os.path.abspath(os.path.join(cwd, offload.nvme_path))
        problem = nvme_path_problem(path)
        if problem:
            raise ConfigError(f"zero.{key}.nvme_path: {problem}",
                              hint="point nvme_path at a directory on a local disk you can write")
        if not os.path.exists(path):
            notes.append(f"zero.{key}.nvme_path: {path} does not exist; zerorun creates it (its parent exists)")
    return notes


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


def hang_warning_after(environ: Mapping[str, str], configured: float) -> float:
    """ZERORUN_HANG_AFTER_S (as the dashboard reads it) or the config's telemetry.hang_after_s."""
    from zerorun.telemetry.settings import env_number

    return env_number("ZERORUN_HANG_AFTER_S", float, configured, env=environ)


def dry_run_text(job: PreparedJob) -> str:
    text = describe_plan(job.plan, job.node_commands())
    if job.slurm is not None:
        reach = {node.host: node.reach for node in job.plan.nodes}
        lines = slurm.describe(job.slurm, reach, job.plan.master_port,
                               signal_plan(job.save_on_signal, job.requeue))
        text = "\n".join(lines) + "\n" + text
    return text + "\nresolved config:\n" + job.config_json


def write_run_dir(job: PreparedJob) -> None:
    run_dir = Path(job.plan.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(job.config_json)
    (run_dir / "plan.json").write_text(plan_json(job.plan))


class ForgivingStream:
    """stdout for the view, which outlives the reader going away (``zerorun ... | head``).

    The job is not the terminal's: when the reader closes the pipe the job runs on (its logs
    get everything) and exits with its own status. Later writes are dropped, and fd 1 is
    pointed at /dev/null so the interpreter's own flush at exit cannot fail either.
    """

    def __init__(self, stream):
        self._stream = stream
        self.closed_by_reader = False

    def write(self, text: str) -> int:
        if not self.closed_by_reader:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._reader_gone()
        return len(text)

    def flush(self) -> None:
        if not self.closed_by_reader:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._reader_gone()

    def _reader_gone(self) -> None:
        self.closed_by_reader = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, AttributeError, ValueError):
            pass

    def isatty(self) -> bool:
        return bool(getattr(self._stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        return self._stream.fileno()

    def __getattr__(self, name):
        return getattr(self._stream, name)


# --- signals --------------------------------------------------------------------------------
#
# Note [Slurm signals]: Slurm talks to a job with signals. scancel, the time limit and
# preemption send SIGTERM (then SIGKILL after KillWait); ``--signal=B:USR1@N`` sends SIGUSR1 to
# the batch script N seconds before the time limit; a closed salloc/terminal session sends
# SIGHUP. The launcher handles all of them: TERM, HUP and INT stop every worker (grace, then
# KILL) and end with 128+signal; with checkpoint.on_signal, USR1/USR2 instead ask every worker
# to save a checkpoint (agent -> SIGUSR1 to each worker; the ranks agree on the step,
# worker/save_on_signal.py) and stop, and with checkpoint.requeue the launcher then runs
# ``scontrol requeue`` so the next start resumes (``checkpoint.resume``). Without on_signal,
# USR1/USR2 stop the job like TERM. The last message says what the signal meant, asking
# Slurm for the job's record where SIGTERM alone cannot tell (``signal_meaning``, Note [why
# Slurm sent SIGTERM] in slurm.py).

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
CHECKPOINT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def signal_plan(save_on_signal: bool, requeue: bool) -> list[str]:
    """What each signal will do, for --dry-run and ``zerorun env`` (pure)."""
    usr = "stop every worker (checkpoint.on_signal: true saves a checkpoint first)"
    if save_on_signal:
        usr = "every rank saves a checkpoint at the next step, then stops" + (
            "; then scontrol requeue (the next start resumes)" if requeue else "")
    term = "signals: SIGTERM (scancel, time limit, preemption) and SIGHUP stop every worker, exit 128+signal"
    if save_on_signal:
        term = ("signals: SIGTERM of a preemption (the job's record says so) saves like SIGUSR1; SIGTERM of "
                "scancel or the time limit, and SIGHUP, stop every worker, exit 128+signal")
    return [term, f"signals: SIGUSR1/SIGUSR2 (sbatch --signal=B:USR1@SECONDS): {usr}"]


def signal_meaning(signum: int, cause: str | None = None, in_slurm: bool = False) -> str:
    """What a signal that stopped the job meant, in words (pure); ``cause`` from
    ``slurm.stop_cause`` (Note [why Slurm sent SIGTERM] in slurm.py)."""
    name = signal.Signals(signum).name
    if signum == signal.SIGINT:
        return "interrupted (Ctrl-C)"
    if signum == signal.SIGHUP:
        return "hung up (SIGHUP: the session went away)"
    if cause == "preempted":
        return f"preempted ({name})"  # SIGTERM, or USR1 with preempt_send_user_signal
    if signum in CHECKPOINT_SIGNALS:
        # Outside Slurm nothing has a time limit: someone (a user, a scheduler) asked for a save.
        return f"time limit near ({name})" if in_slurm else f"{name} received (a checkpoint request; not a Slurm job)"
    if cause == "time limit":
        return f"time limit ({name})"
    if cause == "node failure":
        return f"node failure ({name})"
    if cause == "requeued":
        return f"preempted or requeued ({name}; Slurm requeued the job)"
    if cause == "cancelled":
        return f"cancelled ({name}, scancel)"
    if in_slurm:
        return f"signalled ({name}) while Slurm still runs the job (scancel --signal or kill)"
    return f"interrupted ({name})"  # outside Slurm: someone (kill, a supervisor) stopped it


def slurm_job_record(job_id: int, timeout_s: float = 3.0) -> dict[str, str] | None:
    """The job's record as ``scontrol -o show job`` prints it, or None when it cannot be asked."""
    import subprocess

    try:
        done = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return slurm.parse_job_record(done.stdout) if done.returncode == 0 and done.stdout.strip() else None


def slurm_stop_cause(ctx: slurm.SlurmContext | None) -> str | None:
    """Why Slurm is ending this job now (asks scontrol; None outside Slurm or when it is not)."""
    import time

    if ctx is None:
        return None
    record = slurm_job_record(ctx.job_id)
    ending = record is not None and record.get("JobState", "").upper() not in ("RUNNING", "")
    down = slurm_down_nodes(ctx.job_nodes) if ending else []
    return slurm.stop_cause(record, ctx.restart_count, end_time=ctx.end_time, now=time.time(), down=down)


def slurm_down_nodes(nodes: Iterable[str], timeout_s: float = 3.0) -> list[str]:
    """Which of ``nodes`` Slurm has marked down or not responding ([] when it cannot be asked)."""
    import subprocess

    names = ",".join(nodes)
    if not names:
        return []
    try:
        done = subprocess.run(["scontrol", "-o", "show", "node", names], capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return slurm.down_nodes(done.stdout) if done.returncode == 0 else []


def requeue_slurm_job(job_id: int) -> str | None:
    """``scontrol requeue JOB``; None when done, else why not (one line)."""
    import subprocess

    try:
        done = subprocess.run(["scontrol", "requeue", str(job_id)], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"scontrol requeue failed: {err}"
    if done.returncode != 0:
        return "scontrol requeue failed: " + (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    return None


def step_view(job: PreparedJob, default, extra: dict):
    """Under ``srun ... zerorun`` on several nodes: node 0's view shows every node's ranks and
    the others forward theirs to it (Note [one view under srun] in job_view.py)."""
    role = job.step_role
    if role is None or len(role.nodes) < 2:
        return default
    from zerorun.launch import job_view

    extra.update(nodes=role.nodes, per_node=len(job.plan.nodes[0].workers))
    if role.node_rank == 0:
        return job_view.JobWideView
    extra["node_rank"] = role.node_rank
    return job_view.NodeView


def execute(job: PreparedJob, view_factory=None):
    """Pre-flight, write the run dir, start and supervise; returns a JobResult."""
    from zerorun.launch import early_signals
    from zerorun.launch.preflight import preflight
    from zerorun.launch.supervisor import JobResult, Supervisor

    # Note [signals from the first instant] (early_signals.py): what came before now, and during
    # the pre-flight, is acted on here; a stopping signal means nothing starts at all.
    early: list[int] = []

    def stopped_before_start() -> JobResult | None:
        early.extend(early_signals.take())
        signum = early_signals.first_stop(early, job.save_on_signal)
        if signum is None:
            return None
        return JobResult(None, True, {}, job.plan.run_dir, signal=signum, started=False)

    if (result := stopped_before_start()) is not None:
        return result
    preflight(job.plan, ssh_port=job.options.ssh_port, ssh_options=job.ssh_options)
    if (result := stopped_before_start()) is not None:
        return result
    write_run_dir(job)
    extra = {}
    if view_factory is None:
        from zerorun.ui.live import JobView as view_factory

        extra["stream"] = ForgivingStream(sys.stdout)
        view_factory = step_view(job, view_factory, extra)
    view = view_factory(
        run_dir=Path(job.plan.run_dir), token=job.token, world_size=job.plan.world_size,
        dashboard=job.options.dashboard, **extra,
    )
    supervisor = Supervisor(
        job.plan, view, grace_s=job.options.grace_s, ssh_port=job.options.ssh_port, ssh_options=job.ssh_options,
        files={f"{job.plan.run_dir}/config.json": job.config_json}, token=job.token,
        hang_timeout_s=job.hang_timeout_s, hang_warn_s=job.hang_warn_s, startup_timeout_s=job.startup_timeout_s,
        # Note [why Slurm sent SIGTERM]: with on_signal a preemption's SIGTERM saves, as USR1 does.
        is_preemption=(lambda: slurm_stop_cause(job.slurm) == "preempted")
        if job.save_on_signal and job.slurm is not None else None,
    )

    def on_signal(signum, _frame):
        if signum in CHECKPOINT_SIGNALS and job.save_on_signal:
            supervisor.request_checkpoint(signum)
        elif signum == signal.SIGTERM:
            supervisor.judge_term(signum)  # stops, unless Slurm says it is a preemption (on_signal)
        else:
            supervisor.interrupt(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in HANDLED_SIGNALS}
    for signum in early + early_signals.take():
        on_signal(signum, None)  # a checkpoint signal from before the start: saved at the first step
    try:
        return supervisor.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
