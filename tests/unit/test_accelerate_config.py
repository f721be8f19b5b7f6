"""pytest tests/unit/test_accelerate_config.py — ``zerorun --accelerate-config`` (zerorun/launch/accelerate_config.py)
and what ``accelerate launch --use_deepspeed`` imports from the shim (``deepspeed.launcher.runner``).

The workers' variables are compared with Accelerate 1.15's own launcher's for the same file
(its ``prepare_deepspeed_cmd_env``, run in a child with the shim on PYTHONPATH, as a user's
``accelerate launch`` would be); the end-to-end runs are tests/e2e/test_accelerate_launch.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from zerorun.deepspeed.as_deepspeed import SHIM_DIR
from zerorun.errors import ConfigError
from zerorun.launch.accelerate_config import from_accelerate_config, merge_into

ROOT = Path(__file__).resolve().parents[2]

# What `accelerate config` writes for DeepSpeed ZeRO-3 on one machine with two processes, in bf16.
WRITTEN = {**yaml.safe_load((ROOT / "tests" / "data" / "hf_deepspeed" / "accelerate_zero3.yaml").read_text()),
           "mixed_precision": "bf16"}
WITH_FILE = {"distributed_type": "DEEPSPEED", "num_processes": 3, "main_process_port": 29611,
             "deepspeed_config": {"deepspeed_config_file": "ds.json", "zero3_init_flag": True}}

# Accelerate's launcher process, in one child: its DeepSpeed check and import (through the shim),
# then the variables it gives the workers for each file.
ACCELERATES_OWN = """
import json, os, sys
from accelerate.utils import is_deepspeed_available
assert is_deepspeed_available()
from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
from accelerate.commands.launch import launch_command_parser, _validate_launch_command
from accelerate.utils.launch import prepare_deepspeed_cmd_env
out = {"environment_name": DEEPSPEED_ENVIRONMENT_NAME}
for path in sys.argv[1:]:
    args = launch_command_parser().parse_args(["--config_file", path, "train.py"])
    args, defaults, mixed_precision_from_file = _validate_launch_command(args)
    # accelerate launch's own two lines before its DeepSpeed launcher (commands/launch.py)
    fields = list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mixed_precision_from_file else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = prepare_deepspeed_cmd_env(args)
    out[path] = {"env": {k: v for k, v in env.items() if k.startswith("ACCELERATE_") and k not in os.environ},
                 "nproc_per_node": int(args.nproc_per_node)}
print(json.dumps(out))
"""
FILES = {"written": WRITTEN, "config-file": WITH_FILE}


@pytest.fixture(scope="module")
def accelerates_own(tmp_path_factory) -> dict:
    pytest.importorskip("accelerate")
    folder = tmp_path_factory.mktemp("accelerate_config")
    for name, data in FILES.items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(data))
    environ = {key: value for key, value in os.environ.items() if not key.startswith("ACCELERATE_")}
    done = subprocess.run([sys.executable, "-c", ACCELERATES_OWN, *(f"{name}.yaml" for name in FILES)], cwd=folder,
                          capture_output=True, text=True, timeout=300,
                          env={**environ, "PYTHONPATH": f"{SHIM_DIR}{os.pathsep}{ROOT}"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", FILES)
def test_the_workers_get_what_accelerate_launch_gives_them(accelerates_own, name):
    theirs = accelerates_own[f"{name}.yaml"]
    ours = from_accelerate_config(FILES[name])
    assert ours.env == theirs["env"]
    assert ours.processes_per_host == theirs["nproc_per_node"]
    assert ours.notes == []  # what `accelerate config` writes by default says nothing


def test_the_file_fills_only_what_the_command_line_left_open():
    from zerorun.launch.plan import Target
    from zerorun.launch.prepare import LaunchOptions

    launch = from_accelerate_config(WITH_FILE)
    options = merge_into(LaunchOptions(target=Target(script="train.py")), launch, gpu_counter=lambda: 0)
    assert (options.nproc, options.gpus, options.as_deepspeed, options.master_port) == (3, None, True, 29611)
    assert options.extra_env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == "ds.json"
    on_gpus = merge_into(LaunchOptions(target=Target(script="train.py")), launch, gpu_counter=lambda: 8)
    assert (on_gpus.nproc, on_gpus.gpus) == (None, 3)
    given = merge_into(LaunchOptions(target=Target(script="train.py"), nproc=2, master_port=4000), launch,
                       gpu_counter=lambda: 0)
    assert (given.nproc, given.gpus, given.master_port) == (2, None, 4000)


def test_several_machines_come_from_the_deepspeed_hostfile():
    launch = from_accelerate_config({
        "distributed_type": "DEEPSPEED", "num_processes": 16, "num_machines": 2, "main_process_ip": "10.0.0.1",
        "deepspeed_config": {"deepspeed_hostfile": "hosts", "deepspeed_exclusion_filter": "node-1:7",
                             "deepspeed_multinode_launcher": "pdsh", "zero_stage": 2}})
    assert (launch.processes_per_host, launch.num_machines, launch.hostfile, launch.exclude, launch.master_addr) == (
        8, 2, "hosts", "node-1:7", "10.0.0.1")


@pytest.mark.parametrize(("data", "message"), [
    ({**WRITTEN, "distributed_type": "MULTI_GPU"}, "distributed_type = 'MULTI_GPU': zerorun --accelerate-config runs DeepSpeed jobs"),
    ({**WRITTEN, "num_proceses": 2}, "num_proceses: unknown Accelerate config key (did you mean 'num_processes'?)"),
    ({**WRITTEN, "deepspeed_config": {"zero_stag": 3}}, "deepspeed_config.zero_stag: unknown Accelerate DeepSpeed key (did you mean 'zero_stage'?)"),
    ({**WRITTEN, "mixed_precision": "fp8"}, "mixed_precision = 'fp8': must be fp8 is not supported by zerorun"),
    ({**WRITTEN, "use_cpu": True}, "use_cpu = true: accelerate launch runs DeepSpeed only without --cpu"),
    ({**WRITTEN, "num_processes": 0}, "num_processes = 0: must be a whole number of at least 1"),
    ({**WRITTEN, "num_machines": 2}, "deepspeed_config.deepspeed_hostfile: num_machines is 2: name the hostfile"),
])
def test_a_bad_file_is_one_line_naming_the_key(data, message):
    with pytest.raises(ConfigError) as info:
        from_accelerate_config(data)
    assert message in str(info.value)


def test_the_cli_reads_the_file_and_plans_the_job(tmp_path):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump({**WRITTEN, "dynamo_config": {"dynamo_backend": "INDUCTOR"}}))
    done = subprocess.run([sys.executable, "-m", "zerorun", "--accelerate-config", "accelerate.yaml", "--dry-run",
                           "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "zerorun: note: accelerate config dynamo_config: accepted; has no effect on zerorun's launcher" in done.stderr
    assert "ACCELERATE_DEEPSPEED_ZERO_STAGE=3" in done.stderr and "ACCELERATE_MIXED_PRECISION=bf16" in done.stderr
    assert "--as-deepspeed: the workers' `import deepspeed` is zerorun.deepspeed" in done.stderr
    assert done.stdout.count("ACCELERATE_USE_DEEPSPEED") >= 2  # each of the two workers' variables
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**WRITTEN, "distributed_type": "FSDP"}))
    bad = subprocess.run([sys.executable, "-m", "zerorun", "--accelerate-config", "bad.yaml", "train.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("zerorun: error: invalid config 'bad.yaml' (accelerate config): distributed_type")


def test_the_shim_has_what_accelerate_launch_imports_and_prints_its_path(accelerates_own):
    from zerorun.deepspeed.launcher import runner

    assert accelerates_own["environment_name"] == ".deepspeed_env"  # imported by Accelerate's launcher
    assert runner.DEEPSPEED_ENVIRONMENT_NAME == os.getenv("DS_ENV_FILE", ".deepspeed_env")
    assert runner.PDSH_MAX_FAN_OUT == 1024 and callable(runner.main)
    from typer.testing import CliRunner

    from zerorun.cli.main import build_app

    done = CliRunner().invoke(build_app(), ["env", "--deepspeed-shim"])
    assert done.exit_code == 0 and done.output.strip() == str(SHIM_DIR)
