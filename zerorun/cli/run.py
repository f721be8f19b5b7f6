"""``zerorun [options] SCRIPT [script args...]`` (or ``zerorun run ...``): launch a job.

    zerorun --nproc 2 train.py --lr 3e-4          # 2 CPU workers (gloo)
    zerorun --gpus 8 -m mypkg.train --epochs 3     # 8 GPU workers, python -m style
    zerorun --hostfile hosts --dry-run train.py    # print the plan, start nothing

Everything after the script (or after ``-m MODULE``) belongs to the script: ``split_argv``
finds that point before typer parses anything, so a script's ``--help`` or ``--nproc`` is
never taken as ours.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

from zerorun.errors import JobFailed, LaunchError

# Our options that take no value; every other option takes one (unless written --opt=value).
FLAG_OPTIONS = frozenset({"--no-dashboard", "--dry-run", "--help", "-h", "--resume"})
MODULE_OPTIONS = ("-m", "--module")


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``[launcher options] [-m MODULE | SCRIPT] [script args]`` into (ours, the script's).

    The module option stays on our side; the script name starts the script's side.
    """
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--":
            return argv[:index], argv[index + 1:]
        if word in MODULE_OPTIONS:
            return argv[: index + 2], argv[index + 2:]
        if word.startswith("--module=") or (word.startswith("-m") and not word.startswith("--") and len(word) > 2):
            return argv[: index + 1], argv[index + 1:]
        if not word.startswith("-") or word == "-":
            return argv[:index], argv[index:]
        index += 1 if (word in FLAG_OPTIONS or "=" in word) else 2
    return argv, []


def route_run_argv(argv: list[str]) -> list[str]:
    """``[opts] SCRIPT args`` -> ``[opts] -- SCRIPT args`` so click never parses script args."""
    ours, theirs = split_argv(argv)
    return [*ours, "--", *theirs] if theirs else ours


def register(app: typer.Typer) -> None:
    @app.command("run", help="Launch SCRIPT (or -m MODULE) on every rank; the default command.")
    def run(
        target: Optional[list[str]] = typer.Argument(None, metavar="SCRIPT [ARGS]...", show_default=False),
        nproc: Optional[int] = typer.Option(None, "--nproc", help="CPU workers per host (gloo)."),
        gpus: Optional[int] = typer.Option(None, "--gpus", help="GPU workers per host, one per visible GPU."),
        module: Optional[str] = typer.Option(None, "-m", "--module", help="Run a module like python -m."),
        hostfile: Optional[str] = typer.Option(None, "--hostfile", help="DeepSpeed-style hostfile: 'host slots=N'."),
        include: Optional[str] = typer.Option(None, "--include", help="Hosts/slots to use: worker-0:0,2@worker-1."),
        exclude: Optional[str] = typer.Option(None, "--exclude", help="Hosts/slots to leave out (same grammar)."),
        num_nodes: Optional[int] = typer.Option(None, "--num-nodes", help="Use only the first N hosts."),
        master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Rendezvous address (default: first host)."),
        master_port: Optional[int] = typer.Option(None, "--master-port", help="Rendezvous port (default: a free one)."),
        ssh_port: Optional[int] = typer.Option(None, "--ssh-port", help="ssh port of every remote host."),
        ssh_opt: Optional[list[str]] = typer.Option(None, "--ssh-opt", help="Extra ssh argument (repeatable); also env ZERORUN_SSH_OPTS."),
        env_file: Optional[str] = typer.Option(None, "--env-file", help="KEY=VALUE file forwarded to workers (default .zerorun.env)."),
        config: Optional[str] = typer.Option(None, "--config", help="zerorun YAML or DeepSpeed JSON config."),
        settings: Optional[list[str]] = typer.Option(
            None, "--set", help="Config override KEY=VALUE, e.g. --set zero.stage=3 (repeatable; beats env and file)."
        ),
        run_dir: Optional[str] = typer.Option(None, "--run-dir", help="Logs, config and metrics (default ./zerorun-runs/<time>-<id>)."),
        no_dashboard: bool = typer.Option(False, "--no-dashboard", help="Plain prefixed output instead of the live dashboard."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (hosts, ranks, env, commands); start nothing."),
        grace: float = typer.Option(3.0, "--grace", help="Seconds between TERM and KILL when stopping workers."),
        resume: bool = typer.Option(False, "--resume", help="Load the latest checkpoint of checkpoint.dir on start (= --set checkpoint.resume=true)."),
    ) -> None:
        from zerorun.launch.launcher import LaunchOptions, dry_run_text, execute, prepare
        from zerorun.launch.plan import Target
        from zerorun.launch.supervisor import format_failure
        from zerorun.config import parse_settings

        words = list(target or [])
        if module is not None:
            job_target = Target(module=module, args=tuple(words))
        elif words:
            job_target = Target(script=words[0], args=tuple(words[1:]))
        else:
            raise LaunchError("no script given", hint="zerorun --nproc 2 train.py [script args...]  or  zerorun -m package.module")
        options = LaunchOptions(
            target=job_target, nproc=nproc, gpus=gpus, hostfile=hostfile, include=include, exclude=exclude,
            num_nodes=num_nodes, master_addr=master_addr, master_port=master_port, ssh_port=ssh_port,
            ssh_options=list(ssh_opt or []), env_file=env_file, config=config,
            config_overrides=parse_settings(list(settings or []) + (["checkpoint.resume=true"] if resume else [])), run_dir=run_dir,
            dashboard=not no_dashboard, grace_s=grace,
        )
        job = prepare(options)
        for note in job.notes:
            print(f"zerorun: note: {note}", file=sys.stderr)
        if dry_run:
            print(dry_run_text(job))
            return
        result = execute(job)
        logs = f"{result.run_dir}/logs"
        if result.interrupted:
            print(f"zerorun: interrupted; every worker was stopped (logs in {logs})", file=sys.stderr)
            raise typer.Exit(130)
        if result.failure is not None:
            failure = result.failure
            show_root_cause(format_failure(failure))
            who = f"rank {failure.rank} on host {failure.host}" if failure.rank is not None else f"host {failure.host}"
            raise JobFailed(f"{who} failed: {failure.reason}; every other worker was stopped (logs in {logs})")


def show_root_cause(text: str) -> None:
    """The root-cause block: a Rich panel on a terminal, plain lines in logs and pipes."""
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.panel import Panel
        from rich.text import Text

        Console(stderr=True).print(Panel(Text(text), title="zerorun: job failed", border_style="red"))
    else:
        print(text, file=sys.stderr)
