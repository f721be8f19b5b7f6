"""``zerorun [options] SCRIPT [script args...]`` (or ``zerorun run ...``): launch a job.

    zerorun --nproc 2 train.py --lr 3e-4          # 2 CPU workers (gloo)
    zerorun --gpus 8 -m mypkg.train --epochs 3     # 8 GPU workers, python -m style
    zerorun --hostfile hosts --dry-run train.py    # print the plan, start nothing

Everything after the script (or after ``-m MODULE``) belongs to the script: ``split_argv``
finds that point before typer parses anything, so a script's ``--help`` or ``--nproc`` is
never taken as ours.

DeepSpeed and torchrun spellings work too (``canonical_option``): ``--num_gpus`` (= ``--gpus``),
``--deepspeed``/``--deepspeed_config`` (= ``--config``), ``--nnodes`` (= ``--num-nodes``),
``--nproc_per_node`` (= ``--gpus`` where GPUs are visible, else ``--nproc``), and the
underscore form of every option (``--master_port``). A job started with DeepSpeed's spellings,
or whose script is given ``--deepspeed``/``--deepspeed_config``, gets ``--local_rank=N`` appended
to the script's arguments as under DeepSpeed's launcher (``--no-local-rank-arg`` turns it off).
``--as-deepspeed`` lets the workers ``import deepspeed`` and get zerorun.deepspeed
(zerorun/deepspeed/as_deepspeed.py).
"""

from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING

import typer

from zerorun.errors import JobFailed, LaunchError

if TYPE_CHECKING:
    from zerorun.cli.run_options import RunArgs

# Our options that take no value; every other option takes one (unless written --opt=value).
FLAG_OPTIONS = frozenset({"--no-dashboard", "--dry-run", "--help", "-h", "--resume", "--local-rank-arg",
                          "--no-local-rank-arg", "--as-deepspeed", "--standalone"})
MODULE_OPTIONS = ("-m", "--module")


# Other launchers' option names -> ours (after underscores became dashes).
ALIASES = {
    "--num-gpus": "--gpus",
    "--deepspeed": "--config",
    "--deepspeed-config": "--config",
    "--nnodes": "--num-nodes",
    "--nproc-per-node": "--nproc-per-node",  # resolved by resolve_nproc_per_node (needs the GPU count)
}
OUR_OPTIONS = frozenset({
    "--nproc", "--gpus", "--module", "--hostfile", "--include", "--exclude", "--num-nodes", "--master-addr",
    "--master-port", "--ssh-port", "--ssh-opt", "--env-file", "--config", "--set", "--run-dir",
    "--no-dashboard", "--dry-run", "--grace", "--help", "--local-rank-arg", "--no-local-rank-arg", "--launcher",
    "--as-deepspeed", "--accelerate-config", "--max-restarts", "--standalone", "--rdzv-backend", "--rdzv-endpoint",
    "--rdzv-id", "--rdzv-conf",
})
# Spellings only DeepSpeed's launcher uses: a job started with them gets --local_rank=N appended
# to the script's arguments, as DeepSpeed's launcher does (unless --no-local-rank-arg).
DEEPSPEED_SPELLINGS = frozenset({"--num_gpus", "--deepspeed_config", "--deepspeed", "--num_nodes"})


def canonical_option(word: str) -> str:
    """``--master_port=29500`` -> ``--master-port=29500``, ``--num_gpus`` -> ``--gpus``; other words as they are.

    Only launcher-side words go through here (split_argv), so a script's own underscore
    options are never touched.
    """
    if not word.startswith("--") or word == "--":
        return word
    name, eq, value = word.partition("=")
    dashed = name.replace("_", "-")
    dashed = ALIASES.get(dashed, dashed)
    if dashed in OUR_OPTIONS or dashed in ALIASES.values():
        return dashed + eq + value
    return word


def resolve_nproc_per_node(argv: list[str], gpu_counter) -> list[str]:
    """torchrun's ``--nproc-per-node N``: GPU workers where this machine has GPUs, CPU workers otherwise."""
    out: list[str] = []
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--":
            return out + argv[index:]
        if word == "--nproc-per-node" or word.startswith("--nproc-per-node="):
            if "=" in word:
                value = word.partition("=")[2]
            elif index + 1 < len(argv):
                index += 1
                value = argv[index]
            else:
                raise LaunchError("--nproc_per_node needs a number", hint="--nproc_per_node 2")
            out.append(("--gpus=" if gpu_counter() > 0 else "--nproc=") + value)
        else:
            out.append(word)
        index += 1
    return out


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``[launcher options] [-m MODULE | SCRIPT] [script args]`` into (ours, the script's).

    The module option stays on our side; the script name starts the script's side. Our side's
    options are spelt canonically (``canonical_option``).
    """
    argv = list(argv)
    index = 0
    while index < len(argv):
        word = argv[index] = canonical_option(argv[index])
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


def wants_local_rank_arg(launcher_words: list[str], script_args: list[str]) -> bool:
    """DeepSpeed habits on either side: its launcher's spellings, or ``--deepspeed`` /
    ``--deepspeed_config`` among the script's own arguments (pure)."""
    names = {word.partition("=")[0] for word in launcher_words}
    script = {word.partition("=")[0] for word in script_args}
    return bool(names & DEEPSPEED_SPELLINGS) or bool(script & {"--deepspeed", "--deepspeed_config"})


def route_run_argv(argv: list[str], gpu_counter=None) -> list[str]:
    """``[opts] SCRIPT args`` -> ``[opts] -- SCRIPT args`` so click never parses script args;
    ``--local-rank-arg`` added where DeepSpeed habits ask for it and no choice was given."""
    raw = list(argv)
    ours, theirs = split_argv(argv)
    chosen = {"--local-rank-arg", "--no-local-rank-arg"} & set(ours)
    module_job = any(w in MODULE_OPTIONS or w.startswith(("--module=", "-m")) for w in ours)
    if not chosen and wants_local_rank_arg(raw[: len(ours)], theirs if module_job else theirs[1:]):
        ours = [*ours, "--local-rank-arg"]
    if any(w == "--nproc-per-node" or w.startswith("--nproc-per-node=") for w in ours):
        if gpu_counter is None:
            from zerorun.launch.job_hosts import count_gpus as gpu_counter
        ours = resolve_nproc_per_node(ours, gpu_counter)
    return [*ours, "--", *theirs] if theirs else ours


def register(app: typer.Typer) -> None:
    from zerorun.cli.run_options import command

    app.command("run", help="Launch SCRIPT (or -m MODULE) on every rank; the default command.")(command(launch))


def launch(args: RunArgs) -> None:
    """The run command (its options: cli/run_options.py RunArgs): prepare the job, then print its
    plan (--dry-run) or run it, with any restarts, and close it with its state's line and status."""
    from zerorun.launch.prepare import dry_run_text, prepare
    from zerorun.launch.run_job import execute

    options, rdzv_notes = launch_options(args)
    job = prepared_job(options, prepare, dry_run=args.dry_run, accelerate_config=args.accelerate_config,
                       notes=rdzv_notes, max_restarts=args.max_restarts)
    if args.dry_run:
        print(dry_run_text(job))
        return
    print(f"zerorun: run directory {job.plan.run_dir}", file=sys.stderr, flush=True)
    job, result, causes = run_with_restarts(job, args.max_restarts, prepare, execute)
    close_job(job, outcome_of(job, result), restart_summary(causes, args.max_restarts) if args.max_restarts else "")


def launch_options(args: RunArgs):
    """The command line as launch/prepare.py's LaunchOptions (torchrun's rendezvous options read
    into the master address and port), and the notes that reading made."""
    from zerorun.cli.torchrun_options import rendezvous
    from zerorun.launch.prepare import LaunchOptions

    # In the order the errors are checked: the script, the overrides, then torchrun's options.
    target = job_target(args.module, list(args.target or []), args.local_rank_arg)
    overrides = config_overrides(args.settings, args.resume, args.hang_timeout, args.startup_timeout)
    master_addr, master_port, notes = rendezvous(
        standalone=args.standalone, backend=args.rdzv_backend, endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
        conf=args.rdzv_conf, master_addr=args.master_addr, master_port=args.master_port, hostfile=args.hostfile)
    options = LaunchOptions(
        target=target, nproc=args.nproc, gpus=args.gpus, hostfile=args.hostfile, include=args.include,
        exclude=args.exclude, num_nodes=args.num_nodes, master_addr=master_addr, master_port=master_port,
        ssh_port=args.ssh_port, ssh_options=list(args.ssh_opt or []), env_file=args.env_file, config=args.config,
        config_overrides=overrides, run_dir=args.run_dir, dashboard=not args.no_dashboard, grace_s=args.grace,
        launcher=args.launcher, as_deepspeed=args.as_deepspeed,
    )
    return options, notes


def outcome_of(job, result):
    """Note [job state] (launch/outcome.py): the job's last attempt as one Outcome; Slurm is asked
    why it is ending the job only about a failed job under Slurm."""
    from zerorun.launch.outcome import Outcome, job_state

    cause, words = None, None
    if result.started and not result.interrupted and result.failure is not None and job.slurm is not None:
        cause, words = slurm_ended(job)
    return Outcome(job_state(result, words is not None), result, cause, words)


def close_job(job, outcome, restarts: str) -> None:
    """The closing line and exit status of each state (one function per state)."""
    from zerorun.launch.outcome import JobState

    closers = {JobState.NOT_STARTED: close_not_started, JobState.INTERRUPTED: close_interrupted,
               JobState.CHECKPOINTED: close_checkpointed, JobState.SLURM_ENDED: close_slurm_ended,
               JobState.FAILED: close_failed, JobState.SUCCEEDED: close_succeeded}
    closers[outcome.state](job, outcome, restarts)


def say_finished(restarts: str) -> None:
    """After restarts, a job whose workers all ended on their own says how many it took."""
    if restarts:
        print(f"zerorun: the job finished; {restarts}", file=sys.stderr)


def close_succeeded(job, outcome, restarts: str) -> None:
    say_finished(restarts)
    run_dir_line(outcome)


def close_not_started(job, outcome, restarts: str) -> None:
    # Note [signals from the first instant]: a stopping signal came before any worker ran.
    signum = outcome.result.signal
    print(f"zerorun: {stop_reason(job, signum)} before any worker started; nothing was started"
          + requeue_after_stop(job, signum), file=sys.stderr)
    raise typer.Exit(outcome.exit_code)


def run_dir_line(outcome) -> str:
    """Where the logs are, said at the end of a job that started (and the report command)."""
    run_dir = outcome.result.run_dir
    print(f"zerorun: run directory {run_dir} (zerorun report {run_dir})", file=sys.stderr)
    return f"{run_dir}/logs"


def close_interrupted(job, outcome, restarts: str) -> None:
    logs, signum = run_dir_line(outcome), outcome.result.signal
    print(f"zerorun: {stop_reason(job, signum or 2)}; {stopped_clause(outcome.result.leftovers)} (logs in {logs})"
          + requeue_after_stop(job, signum), file=sys.stderr)
    raise typer.Exit(outcome.exit_code)


def close_checkpointed(job, outcome, restarts: str) -> None:
    # Every worker ended on its own, after saving, but the job did not finish: the restarts go
    # in the checkpoint's line, not in a "finished" one.
    finish_after_checkpoint(job, outcome.result, run_dir_line(outcome), restarts)


def close_slurm_ended(job, outcome, restarts: str) -> None:
    # scancel / time limit under salloc, a preemption's SIGTERM to the agent steps: Slurm
    # signalled the steps (the workers died of it) before, or instead of, the launcher; that is
    # the cause, not the worker.
    logs = run_dir_line(outcome)
    print(f"zerorun: {outcome.slurm_words}: Slurm ended the job's steps; {stopped_clause(outcome.result.leftovers)} "
          f"(logs in {logs})" + after_preemption(job, outcome.slurm_cause), file=sys.stderr)
    raise typer.Exit(outcome.exit_code)


def close_failed(job, outcome, restarts: str) -> None:
    from zerorun.launch.failure_text import format_failure

    logs, failure = run_dir_line(outcome), outcome.result.failure
    stopped = stopped_clause(outcome.result.leftovers)
    show_root_cause(format_failure(failure))
    who = f"rank {failure.rank} on host {failure.host}" if failure.rank is not None else f"host {failure.host}"
    if failure.rank is not None:
        stopped = stopped.replace("every worker", "every other worker")
    raise JobFailed(f"{who} failed: {failure.reason}; {stopped} (logs in {logs})" + (f"; {restarts}" if restarts else ""))


def job_target(module: str | None, words: list[str], local_rank_arg: bool):
    """``-m MODULE [args]`` or ``SCRIPT [args]`` as the plan's Target."""
    from zerorun.launch.plan import Target

    if module is not None:
        return Target(module=module, args=tuple(words), local_rank_arg=local_rank_arg)
    if words:
        return Target(script=words[0], args=tuple(words[1:]), local_rank_arg=local_rank_arg)
    raise LaunchError("no script given", hint="zerorun --nproc 2 train.py [script args...]  or  zerorun -m package.module")


def config_overrides(settings: list[str] | None, resume: bool, hang_timeout: float | None,
                     startup_timeout: float | None) -> dict:
    """--set, --resume, --hang-timeout and --startup-timeout as config overrides (they beat env and file)."""
    from zerorun.config import parse_settings

    overrides = parse_settings(list(settings or []) + (["checkpoint.resume=true"] if resume else []))
    for flag, key, value in (("--hang-timeout", "telemetry.hang_timeout_s", hang_timeout),
                             ("--startup-timeout", "telemetry.startup_timeout_s", startup_timeout)):
        if value is None:
            continue
        if not value >= 0:
            raise LaunchError(f"{flag} must be 0 (never) or a number of seconds, got {value}")
        overrides[key] = value
    return overrides


def prepared_job(options, prepare, *, dry_run: bool, accelerate_config: str | None, notes: list[str],
                 max_restarts: int):
    """The prepared job (launch/prepare.py), its notes printed; --accelerate-config merged in first."""
    accelerate_notes: list[str] = []
    if accelerate_config is not None:
        options, accelerate_notes = with_accelerate_config(options, accelerate_config)
    if dry_run and options.gpus is not None:
        # A plan for a GPU job is useful on a laptop or a login node too: assume the GPUs exist.
        job = prepare(options, gpu_counter=lambda: options.gpus)
        job.notes.append(f"--dry-run: the {options.gpus} GPU(s) per host are not checked on this machine")
    else:
        job = prepare(options)
    job.notes[:0] = accelerate_notes + notes
    if max_restarts and job.step_role is not None:
        raise LaunchError("--max-restarts: under srun each node's launcher would restart on its own",
                          hint="let Slurm restart the job: checkpoint.on_signal and checkpoint.requeue "
                               "(docs/launch.md, Slurm), or sbatch --requeue")
    for note in job.notes:
        print(f"zerorun: note: {note}", file=sys.stderr)
    check_monitor_packages(job.config_json)
    return job


def run_with_restarts(job, max_restarts: int, prepare, execute):
    """Note [restart from the checkpoint] (launch/restarts.py): execute the job; after a worker's
    failure, again from the last checkpoint, up to ``max_restarts`` times. Returns the last
    attempt's job and result and the cause of each restart."""
    import json
    import time

    from zerorun.launch import restarts

    first_run_dir = job.plan.run_dir
    resume = bool(json.loads(job.config_json).get("checkpoint", {}).get("dir"))
    causes: list[str] = []
    if max_restarts:
        restarts.set_restart_count(0)
    result = execute(job)
    while len(causes) < max_restarts and restarts.restartable(result):
        causes.append(restarts.cause_text(result.failure))
        restart = len(causes)
        wait = restarts.backoff_s(restart)
        where = "from the last complete checkpoint" if resume else "from the start (no checkpoint.dir)"
        print(f"zerorun: restart {restart} of {max_restarts} in {wait:g} s, {where}, after {causes[-1]}",
              file=sys.stderr, flush=True)
        time.sleep(wait)
        restarts.set_restart_count(restart)
        job = prepare(restarts.restart_options(job.options, first_run_dir, restart, resume))
        print(f"zerorun: run directory {job.plan.run_dir} (restart {restart})", file=sys.stderr, flush=True)
        result = execute(job)
    return job, result, causes


def restart_summary(causes: list[str], max_restarts: int) -> str:
    from zerorun.launch.restarts import summary

    return summary(causes, max_restarts)


def check_monitor_packages(config_json: str) -> None:
    """The config's monitor section asks for a writer whose package is missing: say so before
    anything starts (a config the script gives ``initialize`` itself gets a warning instead)."""
    import json

    from zerorun.errors import ConfigError
    from zerorun.telemetry.monitor import missing_packages

    missing = missing_packages(json.loads(config_json).get("monitor") or {})
    if missing:
        raise ConfigError(f"the config's monitor section needs {' and '.join(missing)}, which is not installed",
                          hint="pip install 'zerorun[monitor]'" + (" wandb" if "wandb" in missing else "")
                          + ", or set monitor.<writer>.enabled: false")


def stopped_clause(leftovers: dict[str, str]) -> str:
    """What the launcher can truthfully say about the job's processes after teardown."""
    if not leftovers:
        return "every worker was stopped"
    return "could not confirm that every worker stopped: " + "; ".join(
        f"host {host}: {problem}" for host, problem in sorted(leftovers.items()))


def with_accelerate_config(options, path: str):
    """``--accelerate-config FILE``: the options with the file's job merged in (the command line
    wins), and the notes to print (zerorun/launch/accelerate_config.py)."""
    from zerorun.launch.accelerate_config import merge_into, read_accelerate_config
    from zerorun.launch.job_hosts import count_gpus

    launch = read_accelerate_config(path)
    merged = merge_into(options, launch, count_gpus)
    variables = ", ".join(f"{key}={value}" for key, value in sorted(launch.env.items()))
    return merged, [*launch.notes, f"--accelerate-config {path}: the workers get {variables}"]


def stop_reason(job, signum: int, cause: str | None = None) -> str:
    """What the signal that stopped the job meant (Note [Slurm signals] in launch/signals.py)."""
    from zerorun.launch.signals import signal_meaning, slurm_stop_cause

    if cause is None and signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        cause = slurm_stop_cause(job.slurm)
    reason = signal_meaning(signum, cause, in_slurm=job.slurm is not None)
    if cause in ("preempted", "requeued", "node failure") and not job.save_on_signal and signum == signal.SIGTERM:
        reason += ("; nothing was saved on the signal (checkpoint.on_signal: true saves one): a requeued job "
                   f"resumes from {resume_point(job)}")
    return reason


def resume_point(job) -> str:
    """What a requeued job resumes from when nothing was saved on the signal: the interval
    checkpoint only where the config has one; the launcher cannot see a script's own saves."""
    import json

    checkpoint = json.loads(getattr(job, "config_json", "{}") or "{}").get("checkpoint") or {}
    if checkpoint.get("dir") and checkpoint.get("interval_steps"):
        return "the last interval checkpoint"
    return ("the last checkpoint the script saved, if any, else from the start "
            "(no checkpoint.interval_steps is configured)")


def slurm_ended(job) -> tuple[str | None, str | None]:
    """Why Slurm is ending the job (slurm.stop_cause) and that in words, or (None, None)."""
    from zerorun.launch.signals import signal_meaning, slurm_stop_cause

    cause = slurm_stop_cause(job.slurm)
    if cause is None:
        return None, None
    return cause, signal_meaning(signal.SIGTERM, cause, in_slurm=True).replace(
        " (SIGTERM, scancel)", " (scancel)").replace(" (SIGTERM)", "").replace("SIGTERM; ", "")


def after_preemption(job, cause: str | None) -> str:
    """The closing line's clause after a preemption that killed the workers. Nothing was saved
    on the signal, so the requeued job resumes from the last checkpoint (``resume_point``). A preempted job
    that ends within its grace time counts as ended and Slurm does not requeue it: with
    checkpoint.requeue the launcher does."""
    if cause not in ("preempted", "requeued") or job.slurm is None:
        return ""
    clause = f"; nothing was saved on the signal: the requeued job resumes from {resume_point(job)}"
    if cause == "requeued":
        return clause  # Slurm has requeued it already
    return clause + requeue_clause(job)


def requeue_clause(job) -> str:
    """Requeue a preempted job that the launcher ended within its grace time (Slurm counts it
    as ended and does not), when checkpoint.requeue asks; the closing line's clause."""
    from zerorun.launch.signals import requeue_slurm_job

    if not job.requeue:
        return "; not requeued (checkpoint.requeue is off)"
    problem = requeue_slurm_job(job.slurm.job_id)
    return f"; {problem}" if problem else f"; job {job.slurm.job_id} requeued"


def requeue_after_stop(job, signum: int | None) -> str:
    """A job the launcher stopped on a preemption's SIGTERM (its own, even before any worker
    started, or one found in the job's record, Note [a preemption before the steps] in
    launch/supervisor.py) is requeued with what it had, as one whose workers Slurm killed."""
    from zerorun.launch.signals import slurm_stop_cause

    if job.slurm is None or signum != signal.SIGTERM or slurm_stop_cause(job.slurm) != "preempted":
        return ""
    return requeue_clause(job)


def finish_after_checkpoint(job, result, logs: str, restarts: str = "") -> None:
    """Every rank saved a checkpoint on SIGUSR1/2 and stopped: say so, requeue when asked, and
    exit 128+signal (the job did not finish; Slurm must not count it as completed)."""
    from zerorun.launch.signals import requeue_slurm_job

    reason = stop_reason(job, result.checkpoint_signal)
    message = (f"zerorun: {reason}: every rank saved a checkpoint and stopped (logs in {logs})"
               + (f"; {restarts}" if restarts else ""))
    if job.requeue and job.slurm is not None:
        problem = requeue_slurm_job(job.slurm.job_id)
        message += (f"; {problem}" if problem else
                    f"; job {job.slurm.job_id} requeued (checkpoint.resume picks the checkpoint up)")
    elif job.requeue:
        message += "; not requeued: not a Slurm job"
    print(message, file=sys.stderr)
    raise typer.Exit(128 + result.checkpoint_signal)


def show_root_cause(text: str) -> None:
    """The root-cause block: a Rich panel on a terminal, plain lines in logs and pipes."""
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.panel import Panel
        from rich.text import Text

        Console(stderr=True).print(Panel(Text(text), title="zerorun: job failed", border_style="red"))
    else:
        print(text, file=sys.stderr)
