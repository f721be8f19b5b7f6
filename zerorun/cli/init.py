"""``zerorun init [--template zero2] [--hostfile] [--slurm] [--force] [--dir DIR]``: a config and a script to start from.

Writes ``zerorun.yaml`` (a copy of one of zerorun/templates/*.yaml) and ``train.py`` (a minimal
training script) into the current directory, ``hostfile`` with --hostfile and ``job.sbatch``
(a Slurm batch script: srun-started agents, checkpoint and requeue before the time limit)
with --slurm. Existing files
are never overwritten without --force: they may be the user's edited config.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Optional

import typer

from zerorun.config.problems import did_you_mean
from zerorun.config.sources import DEFAULT_CONFIG_NAME
from zerorun.errors import ConfigError

TEMPLATES = ("zero1", "zero2", "zero3", "zero3-offload")
CONFIG_NAME = DEFAULT_CONFIG_NAME
SCRIPT_NAME = "train.py"
HOSTFILE_NAME = "hostfile"
SBATCH_NAME = "job.sbatch"


def template_text(name: str) -> str:
    """The text of a file shipped in zerorun/templates/."""
    return resources.files("zerorun").joinpath("templates", name).read_text(encoding="utf-8")


def planned_files(template: str, directory: Path, hostfile: bool, slurm: bool = False) -> list[tuple[Path, str]]:
    """(destination, template file name) for each file ``init`` would write (pure)."""
    if template not in TEMPLATES:
        raise ConfigError(f"unknown template {template!r}{did_you_mean(template, TEMPLATES)}",
                          hint="choose one of " + ", ".join(TEMPLATES))
    files = [(directory / CONFIG_NAME, f"{template}.yaml"), (directory / SCRIPT_NAME, "train.py")]
    if hostfile:
        files.append((directory / HOSTFILE_NAME, "hostfile.example"))
    if slurm:
        files.append((directory / SBATCH_NAME, SBATCH_NAME))
    return files


def write_files(files: list[tuple[Path, str]], force: bool) -> None:
    existing = [str(dest) for dest, _ in files if dest.exists()]
    if existing and not force:
        raise ConfigError("refusing to overwrite " + ", ".join(existing),
                          hint="pass --force to replace them, or --dir to write elsewhere")
    for dest, name in files:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(template_text(name), encoding="utf-8")


def register(app: typer.Typer) -> None:
    @app.command("init")
    def init(
        template: str = typer.Option("zero2", "--template", "-t",
                                     help="Starting config: " + ", ".join(TEMPLATES) + "."),
        hostfile: bool = typer.Option(False, "--hostfile", help="Also write an example hostfile."),
        slurm: bool = typer.Option(False, "--slurm", help="Also write job.sbatch, a Slurm batch script."),
        force: bool = typer.Option(False, "--force", help="Overwrite files that already exist."),
        directory: Optional[Path] = typer.Option(None, "--dir", help="Where to write (default: here)."),
    ) -> None:
        """Write a starting zerorun.yaml and train.py into the current directory."""
        files = planned_files(template, directory or Path.cwd(), hostfile, slurm)
        write_files(files, force)
        for dest, name in files:
            typer.echo(f"wrote {dest}  (from template {name})")
        config = files[0][0]
        if slurm:
            typer.echo(f"next on Slurm: {'cd ' + str(directory) + ' && ' if directory else ''}sbatch {SBATCH_NAME}")
        typer.echo(f"next: zerorun --nproc 2 --config {config.name} {SCRIPT_NAME}"
                   if directory is None else
                   f"next: cd {directory} && zerorun --nproc 2 --config {config.name} {SCRIPT_NAME}")
