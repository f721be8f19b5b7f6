"""``zerorun init``: placeholder until its issue lands."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("init", hidden=True)
    def _placeholder() -> None:
        raise typer.Exit(1)
