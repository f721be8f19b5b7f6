"""``zerorun env [--json]``: what this machine offers a zerorun job (DeepSpeed's ``ds_report``).

``zerorun env --deepspeed-shim`` prints only the shim directory of ``--as-deepspeed``
(zerorun/deepspeed/as_deepspeed.py), for a PYTHONPATH under another launcher (``accelerate launch``).

Reports zerorun, Python and torch versions; CUDA, NCCL and gloo availability; the visible GPUs
with their memory; host cores and memory; ssh and sshd (multi-node runs need them); the Slurm
allocation this runs in (its nodes, how each would be reached, the rendezvous port and what each
signal would do); and the optional packages zerorun can use. ``collect`` looks (the effects), ``render`` lays the facts
out (pure), so a test can draw any machine.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import socket
import sys
from typing import Any
from pathlib import Path

import typer

# Optional packages and what each one adds.
EXTRAS = {
    "transformers": "Hugging Face models (estimate --hf-config, the HF integration)",
    "accelerate": "the Accelerate integration",
    "safetensors": "safetensors checkpoints",
    "matplotlib": "PNG plots in zerorun report (pip install 'zerorun[report]')",
    "numpy": "silences torch's 'Failed to initialize NumPy' warning",
}
SSHD_PLACES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")


def register(app: typer.Typer) -> None:
    @app.command("env", help="Report torch, CUDA/NCCL/gloo, GPUs, host memory, ssh and optional packages.")
    def env_command(
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
        deepspeed_shim: bool = typer.Option(
            False, "--deepspeed-shim",
            help="Print only the directory that makes `import deepspeed` mean zerorun.deepspeed, for "
                 "PYTHONPATH (what --as-deepspeed gives workers; e.g. for `accelerate launch --use_deepspeed`)."),
    ) -> None:
        if deepspeed_shim:
            from zerorun.deepspeed.as_deepspeed import SHIM_DIR

            print(SHIM_DIR)
            return
        facts = collect()
        if as_json:
            print(json.dumps(facts, indent=2))
            return
        from rich.console import Console

        Console(highlight=False).print(render(facts))


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect() -> dict:
    """The facts, as plain data. Imports torch (a second or two), nothing else heavy."""
    from zerorun import __version__

    facts: dict = {
        "zerorun": __version__,
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpu_cores": os.cpu_count(),
        "host_memory_bytes": None,
        "ssh": shutil.which("ssh"),
        "sshd": shutil.which("sshd") or next((p for p in SSHD_PLACES if Path(p).exists()), None),
        "extras": {name: _version(name) for name in EXTRAS},
        "slurm": slurm_facts(os.environ),
    }
    try:
        import psutil

        facts["host_memory_bytes"] = psutil.virtual_memory().total
    except Exception:
        pass
    facts.update(_torch_facts())
    return facts


def slurm_facts(environ, hostname: str | None = None, fqdn: str | None = None) -> dict:
    """The Slurm allocation as the launcher would see it: lines for the report, and srun's path."""
    from zerorun.errors import ZerorunError
    from zerorun.launch import slurm
    from zerorun.launch.signals import signal_plan

    facts: dict[str, Any] = {"srun": shutil.which("srun"), "lines": []}
    try:
        ctx = slurm.detect(environ)
    except ZerorunError as err:
        facts["lines"] = [f"Slurm variables cannot be read: {err}"]
        return facts
    if ctx is None:
        facts["lines"] = slurm.describe(None)
        return facts
    hostname = hostname or socket.gethostname()
    here = slurm.local_names(environ, hostname, fqdn or socket.getfqdn())
    if ctx.in_step:
        own = ctx.step_nodes[ctx.node_id] if ctx.node_id is not None and ctx.node_id < len(ctx.step_nodes) else None
        reach = {node: "this launcher" if node == own else "its own srun task's launcher" for node in ctx.step_nodes}
    else:
        reach = {node: "local" if node in here else "srun" for node in ctx.job_nodes}
    facts["lines"] = slurm.describe(ctx, reach, slurm.master_port(ctx.job_id, ctx.step_id), signal_plan(False, False))
    return facts


def _torch_facts() -> dict:
    try:
        import torch
        import torch.distributed as dist
    except Exception as err:
        return {"torch": None, "torch_error": f"{type(err).__name__}: {err}"}
    cuda = torch.cuda.is_available()
    gpus: list[dict[str, Any]] = []
    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "distributed": dist.is_available(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "nccl_version": None,
        "gpus": gpus,
    }
    if facts["nccl"] and cuda:
        try:
            facts["nccl_version"] = ".".join(str(p) for p in torch.cuda.nccl.version())
        except Exception:
            pass
    if cuda:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append({"index": index, "name": props.name, "memory_bytes": props.total_memory})
    return facts


def _gib(n) -> str:
    return "unknown" if n is None else f"{n / 2**30:.1f} GiB"


def _yes(flag, detail: str | None = None) -> str:
    if not flag:
        return "[red]no[/red]"
    from rich.markup import escape

    return f"[green]yes[/green] ({escape(str(detail))})" if detail else "[green]yes[/green]"


def render(facts: dict):
    """A two-column Rich table of ``collect()``'s facts."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="zerorun env", show_header=False, title_justify="left")
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value")
    table.add_row("zerorun", facts["zerorun"])
    table.add_row("python", escape(f"{facts['python']} ({facts.get('executable') or '?'})"))
    table.add_row("platform", escape(facts["platform"]))
    if facts.get("torch") is None:
        table.add_row("torch", f"[red]not importable[/red]: {escape(facts.get('torch_error', ''))}")
    else:
        table.add_row("torch", facts["torch"])
        table.add_row("CUDA", _yes(facts["cuda_available"], facts.get("cuda_version")))
        table.add_row("NCCL", _yes(facts["nccl"] and facts["cuda_available"], facts.get("nccl_version")))
        table.add_row("gloo", _yes(facts["gloo"]))
        gpus = facts.get("gpus") or []
        table.add_row("GPUs", "none visible (CPU workers with --nproc N)" if not gpus else "\n".join(
            escape(f"{g['index']}: {g['name']}, {_gib(g['memory_bytes'])}") for g in gpus))
    table.add_row("host", f"{facts['cpu_cores']} cores, {_gib(facts['host_memory_bytes'])} memory")
    table.add_row("ssh", _yes(facts["ssh"], facts["ssh"]) + ("" if facts["ssh"] else " (needed for --hostfile)"))
    table.add_row("sshd", _yes(facts["sshd"], facts["sshd"]) + ("" if facts["sshd"] else " (needed on remote hosts and by the multi-node tests)"))
    slurm = facts.get("slurm") or {}
    if slurm.get("lines"):
        srun = slurm.get("srun")
        # The row is labelled Slurm already; the lines are worded to stand alone (the launcher prints them).
        lines = [slurm["lines"][0].removeprefix("Slurm: "), *slurm["lines"][1:]]
        table.add_row("Slurm", escape("\n".join(lines) + (f"\nsrun: {srun}" if srun else "\nsrun: not on PATH")))
    for name, version in facts["extras"].items():
        table.add_row(name, f"[green]{escape(version)}[/green]" if version
                      else f"[dim]not installed[/dim]: {escape(EXTRAS[name])}")
    return table
