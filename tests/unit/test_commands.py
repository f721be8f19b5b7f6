"""pytest tests/unit/test_commands.py — ssh commands, env forwarding, argv splitting, failure text (pure)."""

from __future__ import annotations

import shlex
import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerorun.cli.main import route
from zerorun.cli.run import split_argv
from zerorun.errors import LaunchError
from zerorun.launch.commands import (
    forwarded_env,
    parse_env_file,
    parse_ssh_opts,
    remote_shell_command,
    ssh_argv,
)
from zerorun.launch.failure_text import extract_traceback, format_failure
from zerorun.launch.preflight import compare_facts
from zerorun.launch.processes import describe_exit
from zerorun.launch.supervisor import Failure

nasty_words = st.lists(st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))), max_size=6)


@settings(deadline=None)  # a loaded CI machine must not turn slowness into failure
@given(nasty_words)
def test_remote_command_reaches_the_far_shell_verbatim(words):
    """What a POSIX shell on the remote side splits out of our string is exactly our argv."""
    argv = ["/venv/bin/python", "-m", "zerorun.launch.agent", *words]
    command = remote_shell_command("/my dir/it's", argv)
    parsed = shlex.split(command)
    assert parsed[:4] == ["cd", "/my dir/it's", "&&", "exec"]
    assert parsed[4:] == argv


def test_ssh_argv_has_batch_mode_port_options_and_separator():
    argv = ssh_argv("node-1", "cd / && exec true", ssh_port=2222, extra_options=["-i", "key"])
    assert argv[0] == "ssh"
    assert "BatchMode=yes" in argv and any(a.startswith("ConnectTimeout=") for a in argv)
    assert argv[argv.index("-p") + 1] == "2222"
    assert argv[-3:] == ["--", "node-1", "cd / && exec true"]
    assert argv.index("-i") < argv.index("--")


def test_forwarded_env_uses_prefixes_and_env_file_wins():
    environ = {"NCCL_DEBUG": "INFO", "HOME": "/root", "PYTHONPATH": "/src", "ZERORUN_RUN_TOKEN": "x",
               "TORCH_LOGS": "+dynamo", "SSH_AUTH_SOCK": "/tmp/a", "ZERORUN_DEBUG": "1"}
    env = forwarded_env(environ, {"NCCL_DEBUG": "WARN", "MY_FLAG": "1"})
    assert env == {"NCCL_DEBUG": "WARN", "PYTHONPATH": "/src", "TORCH_LOGS": "+dynamo", "ZERORUN_DEBUG": "1", "MY_FLAG": "1"}


def test_env_file_parsing():
    text = "# comment\nexport A=1\nB='two words'  # trailing\nC=\"x=y\"\n\n"
    assert parse_env_file(text) == {"A": "1", "B": "two words", "C": "x=y"}
    with pytest.raises(LaunchError, match=r"\.zerorun\.env line 2: expected KEY=VALUE"):
        parse_env_file("A=1\nnot a pair\n")
    with pytest.raises(LaunchError, match="line 1: No closing quotation"):
        parse_env_file("A='open\n")


def test_ssh_opts_split_like_a_shell():
    assert parse_ssh_opts("-i '/k ey' -o A=b") == ["-i", "/k ey", "-o", "A=b"]
    with pytest.raises(LaunchError, match="ZERORUN_SSH_OPTS"):
        parse_ssh_opts("-i 'oops")


@pytest.mark.parametrize(
    "argv, ours, theirs",
    [
        (["--nproc", "2", "train.py", "--lr", "3e-4"], ["--nproc", "2"], ["train.py", "--lr", "3e-4"]),
        (["--dry-run", "train.py", "--nproc", "9"], ["--dry-run"], ["train.py", "--nproc", "9"]),
        (["--nproc=2", "-m", "pkg.mod", "--help"], ["--nproc=2", "-m", "pkg.mod"], ["--help"]),
        (["-mpkg.mod", "x"], ["-mpkg.mod"], ["x"]),
        (["--nproc", "2", "--", "-weird.py"], ["--nproc", "2"], ["-weird.py"]),
        (["--no-dashboard"], ["--no-dashboard"], []),
    ],
)
def test_split_argv_leaves_script_args_untouched(argv, ours, theirs):
    assert split_argv(argv) == (ours, theirs)


def test_route_inserts_run_and_separator():
    assert route(["--nproc", "2", "t.py", "--x"]) == ["run", "--nproc", "2", "--", "t.py", "--x"]
    assert route(["run", "t.py"]) == ["run", "--", "t.py"]
    assert route(["estimate", "--x"]) == ["estimate", "--x"]
    assert route(["--help"]) == ["--help"]


def test_describe_exit_names_signals():
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"
    assert describe_exit(-signal.SIGBUS) == ("signal SIGBUS (a memory-mapped file it was reading was truncated or "
                                             "removed, such as an NVMe offload file)")
    assert describe_exit(128 + signal.SIGTERM) == "exit code 143 (signal SIGTERM)"


LOG = [
    "step 1 loss 2.0",
    "[rank1]: Traceback (most recent call last):",
    '[rank1]:   File "train.py", line 9, in <module>',
    "[rank1]:     raise RuntimeError('boom')",
    "[rank1]: RuntimeError: boom",
    "teardown noise",
]


def test_traceback_is_extracted_without_torch_rank_prefix():
    assert extract_traceback(LOG) == [
        "Traceback (most recent call last):",
        '  File "train.py", line 9, in <module>',
        "    raise RuntimeError('boom')",
        "RuntimeError: boom",
    ]
    assert extract_traceback(["no trace here"]) == []


def test_failure_text_has_host_rank_reason_log_and_traceback():
    text = format_failure(Failure("node-b", 3, "exit code 1", 1, LOG))
    assert text.splitlines()[0] == "first failure: rank 3 on host node-b: exit code 1"
    assert "  | step 1 loss 2.0" in text and "  | teardown noise" in text
    assert "traceback:\n  | Traceback (most recent call last):" in text
    assert text.count("RuntimeError: boom") == 1


def test_preflight_comparison_reports_every_problem():
    facts = {
        "local": {"python": "3.11.2", "torch": "2.13.0", "cwd_ok": True, "script_ok": True},
        "b": {"python": "3.12.1", "torch": "2.13.0", "cwd_ok": True, "script_ok": False},
        "c": "unreachable over ssh: Connection refused",
        "d": {"python": "3.11.2", "torch": None, "cwd_ok": False},
    }
    assert compare_facts("local", facts, "script train.py") == [
        "b: script train.py not found",
        "b: Python 3.12.1 differs from 3.11.2 on local",
        "c: unreachable over ssh: Connection refused",
        "d: working directory does not exist there",
        "d: torch is not installed for that Python",
    ]


launcher_opts = st.lists(
    st.sampled_from([["--nproc", "2"], ["--no-dashboard"], ["--dry-run"], ["--hostfile=h"], ["--ssh-opt", "-v"],
                     ["--include", "a:0@b"], ["--config", "z.yaml"]]),
    max_size=4,
).map(lambda groups: [word for group in groups for word in group])


@settings(deadline=None)
@given(launcher_opts, st.from_regex(r"[a-z_]{1,8}\.py", fullmatch=True), st.lists(st.text(max_size=8), max_size=6))
def test_script_args_never_reach_the_launcher_parser(ours, script, args):
    assert split_argv([*ours, script, *args]) == (ours, [script, *args])
    assert split_argv([*ours, "-m", "pkg.mod", *args]) == ([*ours, "-m", "pkg.mod"], args)


def test_agent_stamps_telemetry_with_the_rank_and_host_it_knows():
    import json

    from zerorun.launch.agent import stamp_telemetry

    forged = json.dumps({"v": 1, "rank": 0, "host": "elsewhere", "kind": "bye"}).encode() + b"\n"
    assert json.loads(stamp_telemetry(forged, 3, "node-b")) == {"v": 1, "rank": 3, "host": "node-b", "kind": "bye"}
    assert stamp_telemetry(b"[1, 2]\n", 3, "node-b") == "[1, 2]"  # not an object: the collector drops it
    assert stamp_telemetry(b"\xff{\n", 3, None) == "\ufffd{"


def test_remote_agent_imports_the_same_zerorun_as_its_workers():
    from zerorun.launch.commands import agent_argv

    assert agent_argv("/py") == ["/py", "-m", "zerorun.launch.agent"]
    assert agent_argv("/py", {"PYTHONPATH": "/src:/x y"}) == ["env", "PYTHONPATH=/src:/x y", "/py", "-m",
                                                                "zerorun.launch.agent"]
