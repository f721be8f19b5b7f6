"""Command lines and environments for remote hosts (pure).

Inside a Slurm allocation the agent of a node is a one-task step instead (``srun_argv``): it
gets the job's whole environment (``--export=ALL``, so ``module load`` paths too), counts in
the job's accounting and is ended by Slurm with the job (scancel, time limit, node failure).

Remote hosts run one agent each (``python -m zerorun.launch.agent``) through the system
OpenSSH client, so ``~/.ssh/config`` applies. ssh joins its trailing arguments with spaces
and hands them to the remote user's shell, so we build that one string ourselves with every
element passed through ``shlex.quote``: nothing a user typed can be interpreted by a shell.
The job's argv and environment do not travel on the command line at all: they go to the
agent as one JSON line on its stdin (see agent.py), which also keeps the run token out of
``ps`` listings on the remote host.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping

from zerorun.errors import LaunchError

# Variables whose names start with one of these are forwarded to remote workers; the rest
# of the launcher's environment (HOME, PATH, SSH_*, ...) belongs to this machine only.
FORWARD_PREFIXES = (
    "ZERORUN_",
    "NCCL_",
    "PYTHON",
    "CUDA_",
    "TORCH_",
    "OMP_",
    "MKL_",
    "GLOO_",
    "HF_",
    "TRANSFORMERS_",
    "WANDB_",
)
# Never forwarded even though they match a prefix: they describe this machine or this run's
# plan and are set per worker instead.
NOT_FORWARDED = frozenset(
    {"ZERORUN_RUN_TOKEN", "ZERORUN_TELEMETRY_FD", "ZERORUN_SSH_OPTS", "PYTHONHOME", "PYTHONEXECUTABLE"}
)

DEFAULT_SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=15")


def forwarded_env(environ: Mapping[str, str], env_file: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables remote workers get from the launcher: prefixed ones, then the env file."""
    chosen = {
        key: value
        for key, value in environ.items()
        if key.startswith(FORWARD_PREFIXES) and key not in NOT_FORWARDED
    }
    chosen.update(env_file or {})
    return chosen


def parse_env_file(text: str, source: str = ".zerorun.env") -> dict[str, str]:
    """``KEY=VALUE`` lines (optional ``export``, shell-style quoting, ``#`` comments)."""
    result: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].strip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise LaunchError(f"{source} line {number}: expected KEY=VALUE, got {raw.strip()!r}")
        try:
            words = shlex.split(value, comments=True)
        except ValueError as err:
            raise LaunchError(f"{source} line {number}: {err} in {value!r}") from None
        result[key] = " ".join(words)
    return result


def parse_ssh_opts(text: str) -> list[str]:
    """Split ZERORUN_SSH_OPTS the way a shell would (it is typed like one)."""
    try:
        return shlex.split(text)
    except ValueError as err:
        raise LaunchError(f"ZERORUN_SSH_OPTS: {err} in {text!r}") from None


def remote_shell_command(cwd: str, argv: Iterable[str]) -> str:
    """``cd CWD && exec ARGV...`` with every element quoted for a POSIX shell."""
    return f"cd {shlex.quote(cwd)} && exec " + " ".join(shlex.quote(part) for part in argv)


def agent_argv(python: str, forwarded: Mapping[str, str] | None = None) -> list[str]:
    """The agent's command. A remote agent gets the forwarded PYTHONPATH on its command line:
    it must import the same zerorun as the workers it starts (they get it in their env)."""
    pythonpath = (forwarded or {}).get("PYTHONPATH")
    head = ["env", f"PYTHONPATH={pythonpath}"] if pythonpath else []
    return [*head, python, "-m", "zerorun.launch.agent"]


def ssh_argv(
    host: str,
    remote_command: str,
    *,
    ssh_port: int | None = None,
    extra_options: Iterable[str] = (),
    ssh_binary: str = "ssh",
) -> list[str]:
    """The local ssh command that runs ``remote_command`` (already quoted) on ``host``."""
    argv = [ssh_binary, "-T", *DEFAULT_SSH_OPTIONS]
    if ssh_port is not None:
        argv += ["-p", str(ssh_port)]
    argv += list(extra_options)
    # "--" so a host name can never be read as an ssh option.
    return [*argv, "--", host, remote_command]


def srun_argv(host: str, cwd: str, argv: Iterable[str], *, srun_binary: str = "srun", overlap: bool = False) -> list[str]:
    """The srun command that runs ``argv`` as a one-task step on node ``host`` of this allocation.

    ``--whole``: the step gets every CPU (and GPU) the job holds on the node, since the agent
    starts all of the node's workers (a plain one-task step gets one CPU). ``--kill-on-bad-exit``
    ends the step when the agent fails. ``overlap``: share the node with running steps (the
    pre-flight, and the check that no worker is left after a failed agent). The step's name tells
    the two apart in ``sacct``: ``zerorun-agent`` is a node's workers, ``zerorun-check`` one of these.
    """
    name = "zerorun-check" if overlap else "zerorun-agent"
    head = [srun_binary, "--nodes=1", "--ntasks=1", "-w", host, "--export=ALL", "--kill-on-bad-exit=1",
            f"--chdir={cwd}", f"--job-name={name}", "--quiet"]
    head.append("--overlap" if overlap else "--whole")
    return [*head, "--", *argv]


def node_agent_command(reach: str, host: str, cwd: str, python: str, forwarded: Mapping[str, str] | None = None,
                       *, ssh_port: int | None = None, ssh_options: Iterable[str] = ()) -> list[str]:
    """The command that starts ``host``'s agent, however the node is reached."""
    if reach == "local":
        return agent_argv(python)
    if reach == "srun":
        return srun_argv(host, cwd, agent_argv(python))
    return on_host("ssh", host, cwd, agent_argv(python, forwarded), ssh_port=ssh_port, ssh_options=ssh_options)


def on_host(reach: str, host: str, cwd: str, argv: list[str], *, ssh_port: int | None = None,
            ssh_options: Iterable[str] = ()) -> list[str]:
    """``argv`` run in ``cwd`` on remote ``host`` over ssh or as an overlapping srun step."""
    if reach == "srun":
        return srun_argv(host, cwd, argv, overlap=True)
    return ssh_argv(host, remote_shell_command(cwd, argv), ssh_port=ssh_port, extra_options=ssh_options)
