"""``zerorun [options] SCRIPT [args...]`` and ``zerorun SUBCOMMAND ...``: the CLI entry point.

Run ``zerorun --help``. Each subcommand lives in its own module under zerorun/cli/ and
registers itself on the typer app; ``run`` is the default when the first word is not a
subcommand, so ``zerorun --nproc 2 train.py --lr 3e-4`` needs no ``run``.
"""

from __future__ import annotations

import os
import sys

import typer

from zerorun.errors import ZerorunError


def build_app() -> typer.Typer:
    from zerorun.cli import consolidate, estimate, init, report, run

    app = typer.Typer(
        add_completion=False,
        no_args_is_help=True,
        help="ZeRO sharded data-parallel training, launched and watched from one command.",
        pretty_exceptions_enable=False,
    )
    for module in (run, estimate, init, report, consolidate):
        module.register(app)
    return app


SUBCOMMANDS = ("run", "estimate", "init", "report", "consolidate")


def route(argv: list[str]) -> list[str]:
    """Insert the default ``run`` subcommand unless argv already names a subcommand or asks for help.

    For ``run``, a ``--`` is placed before the script so its arguments are never parsed as ours.
    """
    from zerorun.cli.run import route_run_argv

    if not argv or argv[0] in ("--help", "-h"):
        return argv
    if argv[0] == "run":
        return ["run", *route_run_argv(argv[1:])]
    if argv[0] in SUBCOMMANDS:
        return argv
    return ["run", *route_run_argv(argv)]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    app = build_app()
    try:
        app(args=route(argv), prog_name="zerorun", standalone_mode=True)
    except ZerorunError as err:
        report_error(err)
        raise SystemExit(err.exit_code) from None
    except KeyboardInterrupt:
        # Ctrl-C before any worker started (during pre-flight, say): nothing to clean up.
        print("zerorun: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


def report_error(err: ZerorunError) -> None:
    """Print a user error as one line (plus a hint line), traceback only under ZERORUN_DEBUG."""
    if os.environ.get("ZERORUN_DEBUG"):
        import traceback

        traceback.print_exception(err)
    print(f"zerorun: error: {err.message}", file=sys.stderr)
    if err.hint:
        print(f"zerorun: hint: {err.hint}", file=sys.stderr)


if __name__ == "__main__":
    main()
