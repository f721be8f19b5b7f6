"""pytest tests/unit/test_cli_aliases_and_help.py — the CLI habits newcomers bring from DeepSpeed and torchrun.

Aliases (--num_gpus, --deepspeed_config, --nproc_per_node, --nnodes, underscores), torchrun's
--max_restarts, --standalone and --rdzv_* (accepted or refused with what to use), --version, --help,
``zerorun env``, did-you-mean for a misspelt subcommand, --dry-run of a GPU job on a machine
without GPUs; through ``main`` in-process (as typer's CliRunner would); the real subprocess is in tests/e2e.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from zerorun.cli.env import render
from zerorun.cli.main import main, route
from zerorun.cli.run import canonical_option, resolve_nproc_per_node, split_argv
from zerorun.cli.torchrun_options import rendezvous
from zerorun.errors import LaunchError

REPO = Path(__file__).resolve().parents[2]


def run_main(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    return (exit_info.value.code or 0), captured.out, captured.err


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("print('never started by --dry-run')\n")
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 4, "zero_optimization": {"stage": 2}}))
    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith(("ZERORUN_", "SLURM_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # this test machine has no GPU, whatever it is
    return tmp_path


@pytest.mark.parametrize("word, canonical", [
    ("--num_gpus", "--gpus"), ("--num-gpus=2", "--gpus=2"), ("--deepspeed", "--config"),
    ("--deepspeed_config", "--config"), ("--nnodes", "--num-nodes"), ("--master_port=29500", "--master-port=29500"),
    ("--master_addr", "--master-addr"), ("--no_dashboard", "--no-dashboard"), ("--dry_run", "--dry-run"),
    ("--nproc", "--nproc"), ("--my_script_flag", "--my_script_flag"), ("train.py", "train.py"),
])
def test_canonical_option(word, canonical):
    assert canonical_option(word) == canonical


def test_script_underscore_options_are_left_alone():
    ours, theirs = split_argv(["--num_gpus", "2", "--dry_run", "train.py", "--master_port", "1", "--num_gpus", "3"])
    assert ours == ["--gpus", "2", "--dry-run"]
    assert theirs == ["train.py", "--master_port", "1", "--num_gpus", "3"]


def test_nproc_per_node_follows_the_gpus():
    assert resolve_nproc_per_node(["--nproc-per-node", "4"], lambda: 8) == ["--gpus=4"]
    assert resolve_nproc_per_node(["--nproc-per-node=2"], lambda: 0) == ["--nproc=2"]
    routed = route(["--nproc_per_node", "2", "train.py", "--nproc_per_node", "9"])
    assert routed[0] == "run" and routed[1] in ("--nproc=2", "--gpus=2")
    assert routed[2:] == ["--", "train.py", "--nproc_per_node", "9"]  # the script's own flag untouched


def test_deepspeed_and_torchrun_spellings_plan_a_job(workdir, capsys):
    code, out, err = run_main(["--nproc_per_node", "2", "--nnodes", "1", "--master_port", "29577",
                               "--deepspeed_config", "ds.json", "--dry_run", "train.py"], capsys)
    assert code == 0, err
    assert "world size 2" in out and "29577" in out and '"stage": 2' in out
    code, out, err = run_main(["--deepspeed", "ds.json", "--nproc", "2", "--dry-run", "train.py"], capsys)
    assert code == 0 and '"stage": 2' in out


def test_version(capsys):
    from zerorun import __version__

    main(["--version"])
    assert capsys.readouterr().out.strip() == f"zerorun {__version__}"


@pytest.mark.parametrize("typo, meant", [("estimat", "estimate"), ("reprot", "report"), ("inti", "init"), ("evn", "env")])
def test_misspelt_subcommand_suggests_the_right_one(workdir, capsys, typo, meant):
    code, out, err = run_main([typo, "--params", "7B"], capsys)
    assert code == 2 and "Traceback" not in err
    assert err.splitlines()[0] == (f"zerorun: error: {typo!r} is neither a subcommand nor a file; "
                                   f"did you mean 'zerorun {meant}'?")


def test_a_missing_script_is_not_taken_for_a_typo(workdir, capsys):
    code, out, err = run_main(["run.py"], capsys)
    assert code == 2 and "did you mean" not in err and "script run.py not found" in err


def test_a_real_file_close_to_a_subcommand_is_still_a_script(workdir, capsys):
    (workdir / "estimat").write_text("print('hi')\n")
    code, out, err = run_main(["--nproc", "1", "--dry-run", "estimat"], capsys)  # options first: a script
    assert code == 0, err
    code, out, err = run_main(["estimat", "--dry-run"], capsys)  # first word is the file: no suggestion
    assert "did you mean" not in err


def test_gpu_dry_run_plans_on_a_machine_without_gpus(workdir, capsys):
    code, out, err = run_main(["--gpus", "8", "--dry-run", "train.py"], capsys)
    assert code == 0, err
    assert "world size 8" in out
    assert "the 8 GPU(s) per host are not checked on this machine" in err
    code, out, err = run_main(["--gpus", "8", "train.py"], capsys)  # a real launch still checks
    assert code == 2 and "asks for 8 GPU(s) but this machine has 0 visible" in err


def test_env_report_renders_any_machine():
    from rich.console import Console

    facts = {"zerorun": "0.1.0", "python": "3.11.7", "platform": "Linux", "cpu_cores": 16,
             "host_memory_bytes": 125 * 2**30, "ssh": "/usr/bin/ssh", "sshd": None,
             "extras": {"transformers": "4.50.0", "accelerate": None, "safetensors": "0.5", "matplotlib": None,
                        "numpy": "2.0"},
             "torch": "2.11.0+cu130", "cuda_available": True, "cuda_version": "13.0", "distributed": True,
             "gloo": True, "nccl": True, "nccl_version": "2.27.3",
             "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 10**9}],
             "slurm": {"lines": ["Slurm: not in an allocation (no SLURM_JOB_ID)"], "srun": None}}
    console = Console(record=True, width=120)
    console.print(render(facts))
    text = console.export_text()
    for words in ("2.11.0+cu130", "yes (13.0)", "yes (2.27.3)", "0: NVIDIA H100 80GB HBM3, 74.5 GiB",
                  "16 cores, 125.0 GiB memory", "sshd", "no (needed on remote hosts",
                  "accelerate", "not installed: the Accelerate integration", "zerorun[report]"):
        assert words in text, words
    slurm_row = next(line for line in text.splitlines() if "not in an allocation" in line)
    assert slurm_row.count("Slurm") == 1, slurm_row  # was "Slurm │ Slurm: not in an allocation"


def test_estimate_model_class_needing_arguments_is_one_line(capsys, monkeypatch):
    """``zerorun estimate --model examples/gpt.py:GPT`` used to end in a 30-line traceback."""
    monkeypatch.chdir(REPO)
    code, out, err = run_main(["estimate", "--model", "examples/gpt.py:GPT"], capsys)
    assert code == 2 and "Traceback" not in err
    assert err.splitlines()[0] == ("zerorun: error: --model 'examples/gpt.py:GPT': GPT needs argument cfg, "
                                   "but --model calls it with none")
    assert len(err.splitlines()) == 2  # the error and its hint


def test_estimate_model_whose_code_fails_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("def build():\n    raise RuntimeError('no weights here')\n"
                                        "def bad_import():\n    pass\nimport not_a_module_xyz\n")
    code, out, err = run_main(["estimate", "--model", "broken.py:build"], capsys)
    assert code == 2 and "Traceback" not in err
    assert "importing 'broken.py' failed: ModuleNotFoundError" in err
    (tmp_path / "broken2.py").write_text("def build():\n    raise RuntimeError('no weights here')\n")
    code, out, err = run_main(["estimate", "--model", "broken2.py:build"], capsys)
    assert code == 2 and "building the model failed: RuntimeError: no weights here" in err


def test_help_names_the_launch_options_and_shows_no_bool_type_for_flags(capsys, monkeypatch):
    """``zerorun --help`` listed only subcommands (--nproc and --config were one level down) and
    every on/off flag read ``--dry-run <bool>`` as if it took a value."""
    monkeypatch.setenv("COLUMNS", "200")
    code, top, _ = run_main(["--help"], capsys)
    assert code == 0 and "--nproc N" in top and "--config FILE" in top and "zerorun run --help" in top
    for argv in (["--help"], ["run", "--help"], ["init", "--help"], ["estimate", "--help"]):
        code, out, _ = run_main(argv, capsys)
        assert code == 0 and "<bool>" not in out, argv
    code, run_help, _ = run_main(["run", "--help"], capsys)
    assert "--dry-run" in run_help and "<int>" in run_help  # options that take a value keep their type


def test_torchrun_spellings_are_accepted_where_they_mean_something(workdir, capsys):
    code, out, err = run_main(["--nproc_per_node", "2", "--max_restarts", "2", "--rdzv_backend",
                               "c10d", "--rdzv_endpoint", "localhost:29411", "--rdzv_id", "job7", "--dry-run",
                               "train.py"], capsys)
    assert code == 0, err
    assert "MASTER_ADDR=localhost" in out and "MASTER_PORT=29411" in out
    assert "--rdzv-id job7: accepted" in err
    code, out, err = run_main(["--nproc", "2", "--standalone", "--rdzv-endpoint", "h:1", "--dry-run", "train.py"], capsys)
    assert code == 0 and "MASTER_ADDR=h" not in out and "--rdzv-endpoint h:1 ignored" in err


@pytest.mark.parametrize("args, words", [
    (["--rdzv-backend", "etcd"], ["--rdzv-backend etcd", "--rdzv-endpoint HOST:PORT"]),
    (["--rdzv-conf", "join_timeout=900"], ["--rdzv-conf", "--startup-timeout"]),
    (["--rdzv-endpoint", "host:port"], ["port must be a number"]),
    (["--standalone", "--hostfile", "hosts"], ["--standalone runs on this host only"]),
])
def test_what_has_no_meaning_is_refused_in_one_line_with_what_to_use(workdir, capsys, args, words):
    code, out, err = run_main(["--nproc", "2", *args, "--dry-run", "train.py"], capsys)
    assert code == 2 and "Traceback" not in err
    assert all(word in err for word in words), err


def test_rendezvous_is_pure_and_keeps_a_port_given_apart():
    assert rendezvous(standalone=False, backend="static", endpoint="node1", rdzv_id=None, conf=None,
                      master_addr=None, master_port=1234, hostfile=None) == ("node1", 1234, [])
    with pytest.raises(LaunchError):
        rendezvous(standalone=False, backend=None, endpoint="a:1", rdzv_id=None, conf=None, master_addr="b",
                   master_port=None, hostfile=None)
