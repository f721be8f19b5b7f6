"""Preparing a job, a chain of values: options -> hosts -> plan -> config -> PreparedJob.

``prepare`` does everything that can fail on bad input, without starting anything (so
``--dry-run`` and real runs share it); ``dry_run_text`` is what --dry-run prints and
``write_run_dir`` the run directory's first files. ``run_job.execute`` starts the prepared job.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from zerorun.config.sources import read_small_file
from zerorun.errors import LaunchError
from zerorun.launch import run_dir as run_dir_lock
from zerorun.launch import slurm
from zerorun.launch.commands import forwarded_env, node_agent_command, parse_env_file, parse_ssh_opts
from zerorun.launch.job_hosts import JobHosts, choose_launcher, count_gpus, free_port, has_nvidia_gpu, job_hosts
from zerorun.launch.plan import LaunchPlan, Target, build_plan, describe_plan, is_local_host, plan_json
from zerorun.launch.run_dir import launch_id
from zerorun.launch.signals import read_partition_grace, signal_plan
from zerorun.launch.slurm import StepRole
from zerorun.worker import preemption_grace
from zerorun.worker.save_on_signal import ENV_NAME as SAVE_ON_SIGNAL_ENV
from zerorun.worker.launch_env import LAUNCH_ID_ENV, RENDEZVOUS_MODE_ENV

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
    # Variables every worker gets beside the plan's (--accelerate-config's ACCELERATE_* ones,
    # zerorun/launch/accelerate_config.py).
    extra_env: dict[str, str] = field(default_factory=dict)


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


# --- prepare --------------------------------------------------------------------------


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
    found = job_hosts(options, environ, context, mode, gpu_counter)
    env_file_vars = _env_file_vars(options, cwd, environ)
    ssh_options = parse_ssh_opts(environ.get("ZERORUN_SSH_OPTS", "")) + list(options.ssh_options)
    token = secrets.token_hex(16)
    all_local = all(is_local_host(h, found.local_names) for h in found.hosts)
    run_notes: list[str] = []
    plan = _job_plan(options, found, context, mode, environ, cwd, env_file_vars, token, all_local, run_notes)
    config, notes = _job_config(options, cwd, plan.world_size, environ, all_local, _rank_hosts(plan))
    notes += run_notes
    notes += _worker_env_for_options(plan, options, config, environ)
    from zerorun.config import to_dict

    return PreparedJob(plan, token, json.dumps(to_dict(config), indent=2), options, ssh_options, notes=notes,
                       hang_timeout_s=config.telemetry.hang_timeout_s,
                       hang_warn_s=hang_warning_after(environ, config.telemetry.hang_after_s),
                       slurm=context, mode=mode, save_on_signal=config.checkpoint.on_signal,
                       requeue=config.checkpoint.requeue,
                       startup_timeout_s=config.telemetry.startup_timeout_s, step_role=found.role)


def _env_file_vars(options: LaunchOptions, cwd: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of --env-file (else ./.zerorun.env where it exists), checked for what every
    rank would refuse only after the start."""
    env_file_vars = {}
    env_file = options.env_file or (DEFAULT_ENV_FILE if os.path.isfile(os.path.join(cwd, DEFAULT_ENV_FILE)) else None)
    if env_file:
        text = read_small_file(Path(cwd) / env_file, "env file", LaunchError)
        env_file_vars = parse_env_file(text, source=env_file)
    from zerorun.zero.comm.shm_names import channel_wanted

    channel_wanted({**environ, **env_file_vars})  # ZERORUN_HOST_CHANNEL: every rank would refuse it after start
    return env_file_vars


def _job_plan(options: LaunchOptions, found: JobHosts, context: slurm.SlurmContext | None, mode: str,
              environ: dict[str, str], cwd: str, env_file_vars: dict[str, str], token: str,
              all_local: bool, notes: list[str]) -> LaunchPlan:
    """The plan of every worker; under srun (``found.role``) only this node's. ``notes`` gets
    what choosing the run directory has to say."""
    hosts, role, local_names = found.hosts, found.role, found.local_names
    plan = build_plan(
        hosts,
        options.target,
        python=sys.executable,
        cwd=cwd,
        run_dir=_run_dir(options, cwd, role, found.step_label, context if mode != "local" else None, notes),
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
        host_cpus=len(os.sched_getaffinity(0)),  # Note [worker threads] in launch/plan.py
    )
    if role is not None:
        # The plan numbers every node's ranks; this launcher runs only its own node's.
        plan = dataclasses.replace(plan, nodes=[node for node in plan.nodes if node.node_rank == role.node_rank])
    for worker in plan.workers:  # scratch records per launch (Note [one launch per run directory])
        worker.env[LAUNCH_ID_ENV] = launch_id(token)
        if role is None:  # one launcher, one token for every rank: Note [authenticated rendezvous]
            worker.env[RENDEZVOUS_MODE_ENV] = "signed"
    return plan


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
             slurm_job: slurm.SlurmContext | None, notes: list[str]) -> str:
    """Note [one launch per run directory] (launch/run_dir.py): a directory a live launch holds
    is refused when named, replaced by a fresh one when not; a requeued Slurm start first waits
    for the previous start to end."""
    if role is not None:
        # One folder per node of the step (several launchers may share a filesystem).
        base = options.run_dir or os.path.join(cwd, "zerorun-runs", step_label)
        path = os.path.abspath(os.path.join(base, f"node{role.node_rank}"))
    else:
        path = os.path.abspath(options.run_dir or default_run_dir(cwd, slurm_job))
    held = run_dir_lock.holder(path) if os.path.isdir(path) else None
    if held and slurm_job is not None and slurm_job.restart_count > 0:
        print(f"zerorun: run directory {path} is in use by {held}; this requeued start waits up to "
              f"{run_dir_lock.REQUEUE_WAIT_S:.0f} s for it to end", file=sys.stderr, flush=True)
        held = run_dir_lock.wait_for_end(path, run_dir_lock.REQUEUE_WAIT_S)
    if not held:
        return path
    if options.run_dir:
        raise LaunchError(f"run directory {path} is in use by {held}",
                          hint="wait for that launch to end, or pass another --run-dir "
                               "(without --run-dir each launch gets its own)")
    fresh = f"{path}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    notes.append(f"run directory {path} is in use by {held}; this launch writes to {fresh}")
    return fresh


def _rank_hosts(plan) -> tuple[int, ...] | None:
    """Each rank's host index in the plan, or None when the plan holds only some of the job's
    ranks (srun's per-node launchers): zero.hpz_partition_size is checked against it."""
    hosts = tuple(index for index, node in enumerate(plan.nodes) for _ in node.workers)
    return hosts if len(hosts) == plan.world_size else None


def _job_config(options: LaunchOptions, cwd: str, world_size: int, environ: Mapping[str, str], all_local: bool,
                hosts: tuple[int, ...] | None = None):
    """The validated config (--config, else ./zerorun.yaml, then environment and --set) and the
    notes to print about it."""
    from zerorun.config import load_config
    from zerorun.config.sources import launcher_config_file

    config_source, config_note = launcher_config_file(options.config, cwd, options.target.script)
    config = load_config(
        config_source, world_size=world_size, overrides=options.config_overrides or None, environ=environ,
        torch_in_child=True, hosts=hosts,
    )
    notes = ([config_note] if config_note else []) + list(config.notes)
    if all_local:
        notes += nvme_path_notes(config, cwd)
        refuse_checkpoint_dir(config, cwd)
    if options.nproc is not None and has_nvidia_gpu():
        notes.append(f"--nproc {options.nproc} runs CPU workers (gloo, ZERORUN_DEVICE=cpu) although this "
                     "machine has GPUs; use --gpus N for GPU workers")
    return config, notes


def _worker_env_for_options(plan: LaunchPlan, options: LaunchOptions, config, environ: Mapping[str, str]) -> list[str]:
    """What --as-deepspeed, --accelerate-config and checkpoint.on_signal add to every worker's
    environment; notes to print."""
    notes = []
    for worker in plan.workers:
        worker.env.update(options.extra_env)
    if options.as_deepspeed:
        from zerorun.deepspeed.as_deepspeed import shadowed_deepspeed, worker_env

        for worker in plan.workers:
            worker.env.update(worker_env({**environ, **plan.forwarded_env, **worker.env}))  # after worker/boot's PYTHONPATH
        real = shadowed_deepspeed()
        notes.append("--as-deepspeed: the workers' `import deepspeed` is zerorun.deepspeed"
                     + (f"; the installed {real} is not used by this job" if real else ""))
    if config.checkpoint.on_signal:
        for worker in plan.workers:
            worker.env[SAVE_ON_SIGNAL_ENV] = "1"
        grace = read_partition_grace(environ)  # Note [preemption grace]
        if grace is not None:
            for worker in plan.workers:
                worker.env[preemption_grace.GRACE_ENV] = str(grace[1])
            notes.append(slurm.grace_note(*grace))
            previous = preemption_grace.start_up_line(plan.run_dir, grace[1], grace[0])
            if previous is not None:
                notes.append(previous)
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


def refuse_checkpoint_dir(config, cwd: str) -> None:
    """Note [refused before training] (checkpoint/owner.py): a checkpoint.dir that can never hold
    checkpoints, or that a live job holds, is refused before any worker starts (ConfigError);
    the engine's rank 0 then takes the lock itself when it starts (checkpoint/schedule.py)."""
    from zerorun.errors import ConfigError
    from zerorun.zero.checkpoint.owner import dir_problem, live_holder

    cfg = config.checkpoint
    if not cfg.dir:
        return
    path = os.path.abspath(os.path.join(cwd, cfg.dir))
    problem = dir_problem(path)
    if problem:
        raise ConfigError(f"checkpoint.dir: {problem}", hint="point checkpoint.dir at a writable directory")
    holder = live_holder(path) if os.path.isdir(path) else None
    if holder and (cfg.interval_steps > 0 or cfg.on_signal):
        raise ConfigError(f"checkpoint.dir {path!r} is in use by {holder}",
                          hint="stop that job first, or save this one to another checkpoint.dir")


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
    """The run directory's first files, once this launch holds its lock (Note [one launch per
    run directory]: a launch that lost a race for it is refused here, before any worker starts)."""
    run_dir_lock.take(job.plan.run_dir, f"launch {launch_id(job.token)}")
    path = Path(job.plan.run_dir)
    (path / "logs").mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(job.config_json)
    (path / "plan.json").write_text(plan_json(job.plan))
