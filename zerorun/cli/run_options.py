"""Every option of ``zerorun run`` in one value, and the typer command built from it.

typer reads a command's options from its function's signature. Here the options are the fields
of ``RunArgs`` (each field's default is typer's declaration of it), and ``command`` gives a
function that signature, so the command's body (cli/run.py ``launch``) receives one typed value
instead of thirty-odd parameters.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import typer


@dataclass(frozen=True)
class RunArgs:
    """What the command line said, after typer parsed it (defaults: typer's declarations)."""

    target: Optional[list[str]] = typer.Argument(None, metavar="SCRIPT [ARGS]...", show_default=False)
    nproc: Optional[int] = typer.Option(None, "--nproc", help="CPU workers per host (gloo).")
    gpus: Optional[int] = typer.Option(None, "--gpus", help="GPU workers per host, one per visible GPU.")
    module: Optional[str] = typer.Option(None, "-m", "--module", help="Run a module like python -m.")
    hostfile: Optional[str] = typer.Option(None, "--hostfile", help="DeepSpeed-style hostfile: 'host slots=N'.")
    include: Optional[str] = typer.Option(None, "--include", help="Hosts/slots to use: worker-0:0,2@worker-1.")
    exclude: Optional[str] = typer.Option(None, "--exclude", help="Hosts/slots to leave out (same grammar).")
    num_nodes: Optional[int] = typer.Option(None, "--num-nodes", help="Use only the first N hosts.")
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Rendezvous address (default: first host).")
    master_port: Optional[int] = typer.Option(None, "--master-port", help="Rendezvous port (default: a free one).")
    ssh_port: Optional[int] = typer.Option(None, "--ssh-port", help="ssh port of every remote host.")
    ssh_opt: Optional[list[str]] = typer.Option(None, "--ssh-opt", help="Extra ssh argument (repeatable); also env ZERORUN_SSH_OPTS.")
    env_file: Optional[str] = typer.Option(None, "--env-file", help="KEY=VALUE file forwarded to workers (default .zerorun.env).")
    config: Optional[str] = typer.Option(None, "--config", help="zerorun YAML or DeepSpeed JSON config.")
    settings: Optional[list[str]] = typer.Option(
        None, "--set", help="Config override KEY=VALUE, e.g. --set zero.stage=3 (repeatable; beats env and file)."
    )
    run_dir: Optional[str] = typer.Option(None, "--run-dir", help="Logs, config and metrics (default ./zerorun-runs/<time>-<id>).")
    no_dashboard: bool = typer.Option(False, "--no-dashboard", help="Plain prefixed output instead of the live dashboard.")
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (hosts, ranks, env, commands); start nothing.")
    grace: float = typer.Option(3.0, "--grace", help="Seconds between TERM and KILL when stopping workers.")
    hang_timeout: Optional[float] = typer.Option(
        None, "--hang-timeout", metavar="SECONDS",
        help="End the job when no rank made progress this long, showing every rank's stack "
             "(config telemetry.hang_timeout_s, default 600; 0 = never). Its clock starts when every "
             "rank has joined the rendezvous: start-up is not a hang.",
    )
    startup_timeout: Optional[float] = typer.Option(
        None, "--startup-timeout", metavar="SECONDS",
        help="End the job when some rank has not joined the rendezvous this long after launch "
             "(config telemetry.startup_timeout_s, default 0 = never).",
    )
    resume: bool = typer.Option(False, "--resume", help="Load the latest checkpoint of checkpoint.dir on start (= --set checkpoint.resume=true).")
    local_rank_arg: bool = typer.Option(
        False, "--local-rank-arg/--no-local-rank-arg",
        help="Append --local_rank=N to the script's arguments, as DeepSpeed's launcher does (on by "
             "default with DeepSpeed launcher flags or a script given --deepspeed/--deepspeed_config).")
    as_deepspeed: bool = typer.Option(
        False, "--as-deepspeed",
        help="The workers' `import deepspeed` gives zerorun.deepspeed (with DeepSpeed's package "
             "metadata), so DeepSpeed programs and transformers/Accelerate run unchanged.")
    accelerate_config: Optional[str] = typer.Option(
        None, "--accelerate-config", metavar="FILE",
        help="Run the DeepSpeed job an `accelerate config` file describes (its process count, "
             "deepspeed_config section and mixed precision become the workers' ACCELERATE_* variables, "
             "as under accelerate launch), with --as-deepspeed; options given here win over the file.")
    launcher: Optional[str] = typer.Option(
        None, "--launcher", metavar="ssh|slurm|local",
        help="How nodes are reached: srun steps inside a Slurm allocation (the default there), "
             "ssh, or local (this machine only, ignoring Slurm).",
    )
    max_restarts: int = typer.Option(
        0, "--max-restarts", metavar="N", min=0,
        help="After a worker failure start the whole job again, from the last complete checkpoint "
             "(checkpoint.dir), up to N times, waiting 1, 2, 4 ... s (torchrun's --max_restarts).")
    standalone: bool = typer.Option(False, "--standalone", help="torchrun's: this host, a free port (the default).")
    rdzv_backend: Optional[str] = typer.Option(None, "--rdzv-backend", help="torchrun's: c10d or static (etcd is refused).")
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="torchrun's: HOST[:PORT] = --master-addr/--master-port.")
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", help="torchrun's job id: accepted, no effect.")
    rdzv_conf: Optional[str] = typer.Option(None, "--rdzv-conf", help="torchrun's: refused (join_timeout is --startup-timeout).")


def command(body: Callable[[RunArgs], None]) -> Callable[..., None]:
    """A function typer can register whose parameters are RunArgs's fields; it calls ``body``."""

    def run(**options) -> None:
        body(RunArgs(**options))

    hints = typing.get_type_hints(RunArgs)
    parameters = [parameter.replace(annotation=hints[name])
                  for name, parameter in inspect.signature(RunArgs).parameters.items()]
    run.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
    run.__annotations__ = {**hints, "return": None}
    return run
