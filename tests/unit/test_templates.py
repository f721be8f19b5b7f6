"""pytest tests/unit/test_templates.py — templates match the schema; `zerorun init` writes them, never clobbering."""

from __future__ import annotations

import ast
from importlib import resources
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from zerorun.cli.init import TEMPLATES
from zerorun.cli.main import build_app
from zerorun.config import OffloadConfig, load_config, to_dict
from zerorun.config.build import field_paths
from zerorun.config.schema import ZerorunConfig
from zerorun.launch.hostfile import parse_hostfile

TEMPLATE_DIR = Path(str(resources.files("zerorun").joinpath("templates")))
EXPECTED_STAGE = {"zero1": 1, "zero2": 2, "zero3": 3, "zero3-offload": 3}


def test_template_directory_holds_exactly_the_documented_files():
    names = sorted(p.name for p in TEMPLATE_DIR.iterdir() if not p.name.startswith((".", "__")))
    assert names == sorted([f"{t}.yaml" for t in TEMPLATES] + ["hostfile.example", "train.py", "job.sbatch"])


@pytest.mark.parametrize("name", TEMPLATES)
def test_every_template_loads_against_the_schema(name):
    path = TEMPLATE_DIR / f"{name}.yaml"
    config = load_config(path, world_size=2, environ={})
    assert config.zero.stage == EXPECTED_STAGE[name]
    assert config.notes == []
    # No key is left to its default silently by a typo: every key written is a schema key...
    written = yaml.safe_load(path.read_text())
    schema_paths = set(field_paths(ZerorunConfig))

    def leaves(data, prefix=""):
        for key, value in data.items():
            path_ = f"{prefix}{key}"
            if isinstance(value, dict) and not path_.endswith("params"):
                yield from leaves(value, path_ + ".")
            else:
                yield path_

    assert set(leaves(written)) <= schema_paths
    # ...and the derived batch obeys the rule for the launcher's world size.
    batch = config.batch
    assert batch.train_batch_size == batch.micro_batch_size * batch.gradient_accumulation_steps * 2


def test_offload_template_offloads_both_families_to_cpu():
    config = load_config(TEMPLATE_DIR / "zero3-offload.yaml", environ={})
    assert config.zero.offload_optimizer == OffloadConfig(device="cpu", pin_memory=True)
    assert config.zero.offload_param == OffloadConfig(device="cpu", pin_memory=True)
    assert config.precision.dtype == "bf16"


def test_templates_differ_from_each_other_in_what_their_names_say():
    dicts = {name: to_dict(load_config(TEMPLATE_DIR / f"{name}.yaml", environ={})) for name in TEMPLATES}
    assert dicts["zero1"]["zero"]["stage"] != dicts["zero2"]["zero"]["stage"]
    assert dicts["zero3"]["zero"]["offload_param"]["device"] == "none"
    assert dicts["zero3-offload"]["zero"]["offload_param"]["device"] == "cpu"


def test_hostfile_example_parses_with_the_launcher_parser():
    hosts = parse_hostfile((TEMPLATE_DIR / "hostfile.example").read_text())
    assert hosts == {"worker-0": 8, "worker-1": 8}


def test_train_script_is_valid_python_whose_docstring_starts_with_its_command():
    tree = ast.parse((TEMPLATE_DIR / "train.py").read_text())
    assert ast.get_docstring(tree).startswith("zerorun --nproc 2 --config zerorun.yaml train.py")


def test_init_writes_config_and_script_and_refuses_to_overwrite(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    app = build_app()
    result = runner.invoke(app, ["init", "--template", "zero3"])
    assert result.exit_code == 0, result.output
    assert "next: zerorun --nproc 2 --config zerorun.yaml train.py" in result.output
    written = (tmp_path / "zerorun.yaml").read_text()
    # The run line names the file as written, not the template it came from.
    assert "# Run:  zerorun --nproc 2 --config zerorun.yaml train.py" in written and "zero3.yaml" not in written
    assert written == (TEMPLATE_DIR / "zero3.yaml").read_text().replace("zero3.yaml", "zerorun.yaml")
    assert (tmp_path / "train.py").read_text() == (TEMPLATE_DIR / "train.py").read_text()
    assert not (tmp_path / "hostfile").exists()

    (tmp_path / "zerorun.yaml").write_text("zero: {stage: 1}\n")  # the user's edits
    result = runner.invoke(app, ["init"])
    assert result.exit_code != 0
    assert "refusing to overwrite" in str(result.exception)
    assert (tmp_path / "zerorun.yaml").read_text() == "zero: {stage: 1}\n"

    result = runner.invoke(app, ["init", "--force", "--hostfile", "--template", "zero3-offload"])
    assert result.exit_code == 0, result.output
    assert load_config(tmp_path / "zerorun.yaml", environ={}).zero.offload_param.device == "cpu"
    assert parse_hostfile((tmp_path / "hostfile").read_text()) == {"worker-0": 8, "worker-1": 8}


def test_init_slurm_beside_an_edited_script_adds_only_the_sbatch_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = build_app()
    assert CliRunner().invoke(app, ["init"]).exit_code == 0
    (tmp_path / "train.py").write_text("print('my edited script')\n")
    result = CliRunner().invoke(app, ["init", "--slurm"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "train.py").read_text() == "print('my edited script')\n"
    assert (tmp_path / "job.sbatch").read_text() == (TEMPLATE_DIR / "job.sbatch").read_text()
    assert f"kept {tmp_path / 'train.py'} as it is" in result.output
    assert f"wrote {tmp_path / 'job.sbatch'}" in result.output
    again = CliRunner().invoke(app, ["init", "--slurm"])  # nothing new to write: refused, nothing touched
    assert again.exit_code != 0 and "refusing to overwrite" in str(again.exception)


def test_init_rejects_an_unknown_template_with_a_suggestion(tmp_path):
    result = CliRunner().invoke(build_app(), ["init", "--template", "zero_2", "--dir", str(tmp_path)])
    assert result.exit_code != 0
    assert str(result.exception) == "unknown template 'zero_2' (did you mean 'zero2'?)"
    assert list(tmp_path.iterdir()) == []


def test_sbatch_template_is_valid_bash_whose_zerorun_line_loads(tmp_path):
    import re
    import subprocess

    from zerorun.cli.init import planned_files, write_files
    from zerorun.cli.run import split_argv
    from zerorun.config import parse_settings

    files = planned_files("zero2", tmp_path, hostfile=False, slurm=True)
    write_files(files, force=False)
    text = (tmp_path / "job.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0
    assert "#SBATCH --signal=B:USR1@" in text and "#SBATCH --requeue" in text
    command = re.search(r"^exec zerorun (.*?)train\.py$", text.replace("\\\n", " "), re.M | re.S).group(1).split()
    ours, _ = split_argv(command + ["train.py"])
    settings = [ours[i + 1] for i, word in enumerate(ours) if word == "--set"]
    config = load_config(tmp_path / "zerorun.yaml", overrides=parse_settings(settings), world_size=2)
    assert config.checkpoint.on_signal and config.checkpoint.requeue and config.checkpoint.resume
