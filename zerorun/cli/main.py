"""``zerorun [options] SCRIPT [args...]`` and ``zerorun SUBCOMMAND ...``: the CLI entry point.

Run ``zerorun --help`` (or ``zerorun --version``). Each subcommand lives in its own module
under zerorun/cli/ and registers itself on the typer app; ``run`` is the default when the first
word is not a subcommand, so ``zerorun --nproc 2 train.py --lr 3e-4`` needs no ``run``. A first
word that is no file but close to a subcommand (``zerorun estimat``) is a typo, not a script.
"""

from __future__ import annotations

import os
import sys
import warnings

from zerorun.errors import LaunchError, ZerorunError
from zerorun.launch import early_signals


def build_app():
    import typer

    from zerorun.cli import consolidate, env, estimate, init, report, run

    _flags_without_type()
    app = typer.Typer(
        add_completion=False,
        no_args_is_help=True,
        help=TOP_HELP,
        pretty_exceptions_enable=False,
    )
    for module in (run, estimate, init, report, env, consolidate):
        module.register(app)
    return app


SUBCOMMANDS = ("run", "estimate", "init", "report", "env", "consolidate")
# The launch options a newcomer needs first are named here: `run` is the default command, so
# its options would otherwise appear only under `zerorun run --help`.
TOP_HELP = (
    "ZeRO sharded data-parallel training, launched and watched from one command.\n\n"
    "zerorun [--nproc N | --gpus N] [--config FILE] [--set KEY=VALUE] SCRIPT [ARGS]: start SCRIPT on "
    "N CPU workers (--nproc) or one worker per GPU (--gpus) with the config FILE (default: ./zerorun.yaml "
    "if there is one); this is the run command, the default, and `zerorun run --help` lists all its "
    "options (--hostfile, --dry-run, --resume, ...).\n\n"
    "zerorun --version prints the version."
)


def _flags_without_type() -> None:
    """An on/off flag (--dry-run, --help) takes no value, but typer's help prints a ``<bool>`` type
    beside it as if it took one; show no type for flags (the --x/--no-x pair already says it)."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich
    if getattr(shown, "flags_untyped", False):
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.flags_untyped = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


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
    _refuse_misspelt_subcommand(argv[0])
    return ["run", *route_run_argv(argv)]


def _refuse_misspelt_subcommand(word: str, is_file=os.path.exists) -> None:
    """``zerorun estimat`` would otherwise launch a script called 'estimat' and fail as a missing file."""
    import difflib

    # A path or a file name (train.py, run.py) is a script that may be missing, not a typo.
    if word.startswith("-") or "." in word or "/" in word or is_file(word):
        return
    close = difflib.get_close_matches(word, SUBCOMMANDS, n=1, cutoff=0.6)
    if close:
        raise LaunchError(f"{word!r} is neither a subcommand nor a file; did you mean 'zerorun {close[0]}'?",
                          hint="subcommands: " + ", ".join(SUBCOMMANDS) + "; anything else is taken for a script")


def launches(routed: list[str]) -> bool:
    """Whether the routed command line starts a job (``run`` without ``--dry-run``), pure."""
    if routed[:1] != ["run"]:
        return False
    ours = routed[1:routed.index("--")] if "--" in routed else routed[1:]
    return "--dry-run" not in ours and "--help" not in ours


def main(argv: list[str] | None = None) -> None:
    # Before anything else (typer is not even imported yet): Note [signals from the first instant].
    early_signals.install()
    try:
        _main(argv)
    finally:
        early_signals.release(raise_pending=False)


def _main(argv: list[str] | None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from zerorun import __version__

        print(f"zerorun {__version__}")
        return
    # torch warns at import when numpy is missing; the launcher never converts to numpy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        routed = route(argv)
        if not launches(routed):
            early_signals.release(raise_pending=True)  # ordinary signal behaviour for the rest
        build_app()(args=routed, prog_name="zerorun", standalone_mode=True)
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
