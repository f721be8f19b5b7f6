"""``zerorun run``: placeholder until its issue lands."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("run", hidden=True)
    def _placeholder() -> None:
        raise typer.Exit(1)
