"""pytest tests/unit/test_frictions.py — the frictions of issue 39's table, one test each (each
fails on the code before the fix):

- a config with an optimizer section is checked without importing torch in the launcher (Note [no
  torch in the launcher]: ``--dry-run`` took 26.9 s vs 2.1 s), and the table it uses agrees with
  the torch installed;
- config errors come in one round when a key is unknown;
- ``activation_checkpointing.modules`` without ``enabled: true`` says so;
- a config beside the script is found when zerorun is started from another directory;
- ``zerorun estimate`` with an init template works without ``--seq-len`` (a default, noted);
- the Trainer without ``--use_cpu`` on CPU workers is told the cause (world size 1 vs the job's).
The straggler row is tests/unit/test_collector.py::test_a_straggler_is_tagged_only_when_its_lag_lasts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from zerorun.config import load_config
from zerorun.config.sources import launcher_config_file
from zerorun.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_an_optimizer_section_is_checked_without_torch_in_the_launcher(tmp_path):
    (tmp_path / "c.yaml").write_text("optimizer: {type: Adamw, params: {lr: 0.1}}\n"
                                     "scheduler: {type: StepLR, params: {step_sise: 3}}\n")
    probe = (
        "import subprocess, sys\n"
        "def refuse(*a, **k): raise OSError('no child process may import torch for the launcher')\n"
        "subprocess.run = refuse\n"
        "from zerorun.config import load_config\n"
        "from zerorun.errors import ConfigError\n"
        "try:\n"
        f"    load_config({str(tmp_path / 'c.yaml')!r}, torch_in_child=True)\n"
        "except ConfigError as error:\n"
        "    print(error)\n"
        "print('torch imported:', 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "optimizer.type = 'Adamw': not a class in torch.optim (did you mean 'AdamW'?)" in done.stdout, done
    assert "scheduler.params.step_sise: torch.optim.lr_scheduler.StepLR takes no such argument" in done.stdout
    assert "torch imported: False" in done.stdout


def test_the_launchers_table_agrees_with_the_torch_installed():
    from zerorun.config import torch_signatures

    assert torch_signatures.signatures() == torch_signatures.SIGNATURES, (
        "torch's classes changed: regenerate SIGNATURES (python -m zerorun.config.torch_signatures)")


def test_an_unknown_key_and_a_combination_problem_come_in_one_round():
    with pytest.raises(ConfigError) as caught:
        load_config({"zero": {"stage": 3, "stagee": 2}, "checkpoint": {"resume": True}})
    message = str(caught.value)
    assert "zero.stagee: unknown key" in message
    assert "checkpoint.resume (--resume) is set but there is no directory" in message  # not a second round


def test_activation_checkpointing_modules_without_enabled_says_so():
    config = load_config({"activation_checkpointing": {"modules": ["GPT2Block"]}})
    assert any("activation_checkpointing.enabled is false: nothing is recomputed; set enabled: true" in note
               for note in config.notes)
    assert load_config(config).notes == config.notes  # loaded again (the engine does): said once
    assert not load_config({"activation_checkpointing": {"enabled": True, "modules": ["GPT2Block"]}}).notes


def test_a_config_beside_the_script_is_found_from_another_directory(tmp_path):
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "zerorun.yaml").write_text("zero: {stage: 2}\n")
    found, note = launcher_config_file(None, str(tmp_path), "proj/train.py")
    assert found == str(tmp_path / "proj" / "zerorun.yaml") and "beside the script" in note
    (tmp_path / "zerorun.yaml").write_text("zero: {stage: 1}\n")  # the working directory's still wins
    assert launcher_config_file(None, str(tmp_path), "proj/train.py")[0] == str(tmp_path / "zerorun.yaml")


def test_estimate_with_an_init_template_needs_no_seq_len(capsys):
    from zerorun.cli.main import main

    template = REPO / "zerorun" / "templates" / "zero3.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--preset", "gpt2", "--gpus", "2", "--config", str(template)])
    captured = capsys.readouterr()
    assert (exit_info.value.code or 0) == 0, captured.err
    assert "activations at --seq-len 2048 (the default" in captured.err
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--params", "7B", "--gpus", "8", "--config", str(template)])
    assert (exit_info.value.code or 0) == 0, capsys.readouterr().err


def test_trainer_without_use_cpu_is_told_the_cause():
    from zerorun.integrations.hf_auto import fill_from_args

    args = SimpleNamespace(world_size=1, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    with pytest.raises(ConfigError) as caught:
        fill_from_args({"train_batch_size": "auto"}, args, environ={"WORLD_SIZE": "2"})
    assert "Trainer sees world size 1, but this job has 2 ranks" in str(caught.value)
    assert "use_cpu=True (--use_cpu)" in caught.value.hint
