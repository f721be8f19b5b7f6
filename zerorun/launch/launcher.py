"""The launcher as a chain of values: options -> hosts -> plan -> config -> pre-flight -> run.

``prepare`` does everything that can fail on bad input, without starting anything (so
``--dry-run`` and real runs share it); ``execute`` starts the job and supervises it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from zerorun.errors import HostfileError, LaunchError
from zerorun.launch.commands import (
    agent_argv,
    forwarded_env,
    parse_env_file,
    parse_ssh_opts,
    remote_shell_command,
    ssh_argv,
)
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

    def node_commands(self) -> dict[str, list[str]]:
        """The agent command each host runs (what --dry-run shows; the supervisor builds the same)."""
        return {
            node.host: agent_argv(self.plan.python)
            if node.local
            else ssh_argv(
                node.host,
                remote_shell_command(self.plan.cwd, agent_argv(self.plan.python, self.plan.forwarded_env)),
                ssh_port=self.options.ssh_port,
                extra_options=self.ssh_options,
            )
            for node in self.plan.nodes
        }


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


def resolve_hosts(options: LaunchOptions, environ: Mapping[str, str], gpu_counter=count_gpus) -> HostSlots:
    """Hosts and slot ids from --hostfile, else Slurm, else this machine (--nproc/--gpus)."""
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
        hosts = slurm_hosts(environ)
        if hosts is None:
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


def default_run_dir(cwd: str) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return str(Path(cwd) / "zerorun-runs" / f"{stamp}-{secrets.token_hex(3)}")


# --- prepare / execute --------------------------------------------------------------------


def prepare(options: LaunchOptions, environ: Mapping[str, str] | None = None, cwd: str | None = None,
            gpu_counter=count_gpus) -> PreparedJob:
    """Validate everything and build the plan; starts nothing, writes nothing."""
    environ = dict(os.environ if environ is None else environ)
    cwd = os.path.abspath(cwd or os.getcwd())
    target = options.target
    if target.script is not None and not os.path.isfile(os.path.join(cwd, target.script)):
        # Checked here as well as in pre-flight so --dry-run catches it too.
        raise LaunchError(f"script {target.script} not found (looked in {cwd})")
    hosts = resolve_hosts(options, environ, gpu_counter)
    local_names = {socket.gethostname()}
    env_file_vars = {}
    env_file = options.env_file or (DEFAULT_ENV_FILE if os.path.isfile(os.path.join(cwd, DEFAULT_ENV_FILE)) else None)
    if env_file:
        text = read_small_file(Path(cwd) / env_file, "env file", LaunchError)
        env_file_vars = parse_env_file(text, source=env_file)
    ssh_options = parse_ssh_opts(environ.get("ZERORUN_SSH_OPTS", "")) + list(options.ssh_options)
    first = next(iter(hosts))
    master_port = options.master_port
    if master_port is None:
        # A free port when the master is this machine (parallel jobs do not collide);
        # torchrun's default otherwise, since we cannot probe another machine's ports.
        master_port = free_port() if is_local_host(first, local_names) else DEFAULT_MASTER_PORT
    token = secrets.token_hex(16)
    run_dir = os.path.abspath(options.run_dir or default_run_dir(cwd))
    plan = build_plan(
        hosts,
        target,
        python=sys.executable,
        cwd=cwd,
        run_dir=run_dir,
        token=token,
        master_port=master_port,
        master_addr=options.master_addr,
        local_names=local_names,
        set_visible_devices=any(":" in (f or "") for f in (options.include, options.exclude)),
        forwarded_env=forwarded_env(environ, env_file_vars) if any(not is_local_host(h, local_names) for h in hosts) else env_file_vars,
        inherited_env=environ,
        this_host_name=socket.gethostname(),
        device_kind="cpu" if options.nproc is not None else "cuda" if options.gpus is not None else None,
    )
    from zerorun.config import load_config, to_dict

    config_source = os.path.join(cwd, options.config) if options.config else None
    config = load_config(
        config_source, world_size=plan.world_size, overrides=options.config_overrides or None, environ=environ,
        torch_in_child=True,
    )
    for key in ("offload_optimizer", "offload_param"):
        nvme = getattr(config.zero, key)
        if nvme.device == "nvme" and nvme.nvme_path and all(is_local_host(h, local_names) for h in hosts):
            from zerorun.errors import ConfigError
            from zerorun.launch.preflight import nvme_path_problem

            problem = nvme_path_problem(os.path.join(cwd, nvme.nvme_path))
            if problem:
                raise ConfigError(f"zero.{key}.nvme_path: {problem}",
                                  hint="point nvme_path at a directory on a local disk you can write")
    config_json = json.dumps(to_dict(config), indent=2)
    notes = list(config.notes)
    if options.nproc is not None and has_nvidia_gpu():
        notes.append(f"--nproc {options.nproc} runs CPU workers (gloo, ZERORUN_DEVICE=cpu) although this "
                     "machine has GPUs; use --gpus N for GPU workers")
    return PreparedJob(plan, token, config_json, options, ssh_options, notes=notes,
                       hang_timeout_s=config.telemetry.hang_timeout_s,
                       hang_warn_s=hang_warning_after(environ, config.telemetry.hang_after_s),
                       startup_timeout_s=config.telemetry.startup_timeout_s)


def hang_warning_after(environ: Mapping[str, str], configured: float) -> float:
    """ZERORUN_HANG_AFTER_S (as the dashboard reads it) or the config's telemetry.hang_after_s."""
    from zerorun.telemetry.settings import env_number

    return env_number("ZERORUN_HANG_AFTER_S", float, configured, env=environ)


def dry_run_text(job: PreparedJob) -> str:
    return describe_plan(job.plan, job.node_commands()) + "\nresolved config:\n" + job.config_json


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


def execute(job: PreparedJob, view_factory=None):
    """Pre-flight, write the run dir, start and supervise; returns a JobResult."""
    from zerorun.launch.preflight import preflight
    from zerorun.launch.supervisor import Supervisor

    preflight(job.plan, ssh_port=job.options.ssh_port, ssh_options=job.ssh_options)
    write_run_dir(job)
    extra = {}
    if view_factory is None:
        from zerorun.ui.live import JobView as view_factory

        extra["stream"] = ForgivingStream(sys.stdout)
    view = view_factory(
        run_dir=Path(job.plan.run_dir), token=job.token, world_size=job.plan.world_size,
        dashboard=job.options.dashboard, **extra,
    )
    supervisor = Supervisor(
        job.plan, view, grace_s=job.options.grace_s, ssh_port=job.options.ssh_port, ssh_options=job.ssh_options,
        files={f"{job.plan.run_dir}/config.json": job.config_json}, token=job.token,
        hang_timeout_s=job.hang_timeout_s, hang_warn_s=job.hang_warn_s, startup_timeout_s=job.startup_timeout_s,
    )
    previous = {
        sig: signal.signal(sig, lambda signum, _frame: supervisor.interrupt(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        return supervisor.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
