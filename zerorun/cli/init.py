"""``zerorun init [--template zero2] [--hostfile] [--slurm] [--force] [--dir DIR]``: a config and a script to start from.

Writes ``zerorun.yaml`` (a copy of one of zerorun/templates/*.yaml) and ``train.py`` (a minimal
training script) into the current directory, ``hostfile`` with --hostfile and ``job.sbatch``
(a Slurm batch script: srun-started agents, checkpoint and requeue before the time limit)
with --slurm. Existing files
are never overwritten without --force: they may be the user's edited config or script. When
some of the files exist and others do not (``init --slurm`` in a directory ``init`` already
set up), only the missing ones are written and the others are kept as they are.
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
    return (resources.files("zerorun") / "templates" / name).read_text(encoding="utf-8")


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


def file_text(dest: Path, name: str) -> str:
    """What ``init`` writes to ``dest`` from template ``name``: a config's run line names the file
    it is written as (zerorun.yaml), not the template it came from (pure but for the read)."""
    text = template_text(name)
    if name.endswith(".yaml"):
        text = text.replace(f"--config {name} ", f"--config {dest.name} ")
    return text


def write_files(files: list[tuple[Path, str]], force: bool) -> list[tuple[Path, str]]:
    """Write the planned files; returns those written. Without ``force`` existing files are
    kept, and having nothing new to write is an error (the user's files stay untouched)."""
    existing = [str(dest) for dest, _ in files if dest.exists()]
    if existing and not force and len(existing) == len(files):
        raise ConfigError("refusing to overwrite " + ", ".join(existing),
                          hint="pass --force to replace them, or --dir to write elsewhere")
    written = [(dest, name) for dest, name in files if force or not dest.exists()]
    for dest, name in written:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(file_text(dest, name), encoding="utf-8")
    return written


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
        written = write_files(files, force)
        for dest, name in files:
            typer.echo(f"wrote {dest}  (from template {name})" if (dest, name) in written
                       else f"kept {dest} as it is (--force replaces it)")
        config = files[0][0]
        if slurm:
            typer.echo(f"next on Slurm: {'cd ' + str(directory) + ' && ' if directory else ''}sbatch {SBATCH_NAME}")
        typer.echo(f"next: zerorun --nproc 2 --config {config.name} {SCRIPT_NAME}"
                   if directory is None else
                   f"next: cd {directory} && zerorun --nproc 2 --config {config.name} {SCRIPT_NAME}")
