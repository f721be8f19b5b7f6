"""pytest tests/unit/test_deepspeed_surface.py — the DeepSpeed names client programs import beyond the
tutorials (DeepSpeed-Chat, transformers' Trainer, Accelerate), ``--as-deepspeed``'s shim, and the
config rules DeepSpeed applies to disabled sections and ``offload_param`` below stage 3.

A world of one where an engine is built (``init_distributed`` starts a one-rank gloo group).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import zerorun.deepspeed as deepspeed
from zerorun.config import load_config
from zerorun.deepspeed import as_deepspeed
from zerorun.errors import ConfigError, UsageError

from deepspeed_alone import alone  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[2]


# -- the --as-deepspeed shim ---------------------------------------------------------------------
SHIM_PROBE = """
import importlib.metadata, json
import deepspeed, zerorun.deepspeed
import deepspeed.runtime.zero.partition_parameters as pp
from zerorun.deepspeed.runtime.zero import partition_parameters as zpp
from deepspeed import DeepSpeedEngine
from deepspeed.ops.adam import FusedAdam
from transformers.integrations.deepspeed import is_deepspeed_available
from accelerate.utils import is_deepspeed_available as accelerate_sees_it
try:
    import deepspeed.no_such_module
    missing = None
except ModuleNotFoundError as err:
    missing = str(err)
print(json.dumps({
    "same_package": deepspeed is zerorun.deepspeed, "same_submodule": pp is zpp,
    "spec_kept": zpp.__spec__.name, "metadata_version": importlib.metadata.version("deepspeed"),
    "version": deepspeed.__version__, "transformers": is_deepspeed_available(),
    "accelerate": accelerate_sees_it(), "engine": DeepSpeedEngine.__module__ + "." + DeepSpeedEngine.__name__,
    "missing": missing,
}))
"""


def test_the_shim_makes_import_deepspeed_zeroruns_with_metadata_transformers_accepts():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    env = {**os.environ, **as_deepspeed.worker_env({"PYTHONPATH": str(ROOT)})}
    done = subprocess.run([sys.executable, "-c", SHIM_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["same_package"] and seen["same_submodule"]  # one module object under both names
    assert seen["spec_kept"] == "zerorun.deepspeed.runtime.zero.partition_parameters"
    assert seen["metadata_version"] == "0.19.8+zerorun"
    assert seen["version"] == as_deepspeed.version() and "+zerorun." in seen["version"]
    assert seen["transformers"] is True and seen["accelerate"] is True
    assert seen["engine"] == "zerorun.zero.engine.Engine"
    assert seen["missing"] == "No module named 'deepspeed.no_such_module'"


def test_without_the_shim_deepspeed_is_not_importable_as_zerorun():
    done = subprocess.run([sys.executable, "-c", "import zerorun.deepspeed, importlib.util, sys; "
                           "print(importlib.util.find_spec('deepspeed') is None or 'zerorun' not in "
                           "str(importlib.util.find_spec('deepspeed').origin))"],
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "True", done.stderr


def test_worker_env_puts_the_shim_first_and_keeps_the_users_path():
    env = as_deepspeed.worker_env({"PYTHONPATH": "/a:/b"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(as_deepspeed.SHIM_DIR), "/a", "/b"]
    assert env[as_deepspeed.ENV_FLAG] == "1"
    assert as_deepspeed.worker_env({})["PYTHONPATH"] == str(as_deepspeed.SHIM_DIR)


def test_the_launcher_gives_every_worker_the_shim(tmp_path):
    from zerorun.launch.prepare import LaunchOptions, prepare
    from zerorun.launch.plan import Target

    (tmp_path / "train.py").write_text("")
    options = LaunchOptions(target=Target(script="train.py"), nproc=2, as_deepspeed=True)
    job = prepare(options, environ={"PYTHONPATH": "/mine"}, cwd=str(tmp_path))
    from zerorun.launch.plan import BOOT_DIR

    for worker in job.plan.workers:  # the shim, then worker/boot (telemetry from the start), then the user's
        assert worker.env["PYTHONPATH"] == os.pathsep.join([str(as_deepspeed.SHIM_DIR), BOOT_DIR, "/mine"])
    assert any(note.startswith("--as-deepspeed: the workers' `import deepspeed` is zerorun.deepspeed")
               for note in job.notes)
    plain = prepare(LaunchOptions(target=Target(script="train.py"), nproc=2), environ={}, cwd=str(tmp_path))
    assert all(worker.env["PYTHONPATH"] == BOOT_DIR for worker in plain.plan.workers)


def test_the_cli_takes_as_deepspeed_as_a_flag_before_the_script():
    from zerorun.cli.run import split_argv

    ours, theirs = split_argv(["--nproc", "2", "--as-deepspeed", "main.py", "--deepspeed"])
    assert ours == ["--nproc", "2", "--as-deepspeed"] and theirs == ["main.py", "--deepspeed"]


# -- module names ---------------------------------------------------------------------------------
def test_top_level_and_runtime_names():
    from zerorun.deepspeed.runtime import lr_schedules
    from zerorun.zero.engine import Engine

    assert deepspeed.get_accelerator is deepspeed.accelerator.get_accelerator
    assert deepspeed.DeepSpeedEngine is Engine is deepspeed.runtime.engine.DeepSpeedEngine
    assert all(hasattr(lr_schedules, name) for name in lr_schedules.VALID_LR_SCHEDULES)
    assert set(lr_schedules.VALID_LR_SCHEDULES) == {"LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR",
                                                     "WarmupCosineLR"}


def test_partition_parameters_names_transformers_swaps_and_reads():
    from zerorun.deepspeed.runtime.zero import partition_parameters as pp

    assert pp._orig_torch_arange is torch.arange
    assert pp.Init is deepspeed.zero.Init and pp.GatheredParameters is deepspeed.zero.GatheredParameters
    assert pp.get_accelerator is deepspeed.get_accelerator
    wrapped = pp.zero_wrapper_for_fp_tensor_constructor(torch.zeros, target_device=torch.device("meta"))
    assert wrapped(3).is_meta and wrapped(3, device="cpu").device.type == "cpu"
    with pytest.raises(AttributeError, match="no 'nothing_like_this'"):
        pp.nothing_like_this  # noqa: B018


def test_compression_helper_attribute_tools_work_and_the_rest_refuses():
    from zerorun.deepspeed.compression.helper import recursive_getattr, recursive_setattr
    from zerorun.errors import UnsupportedFeature

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 3)))
    assert recursive_getattr(model, "1.1") is model[1][1]
    replacement = nn.Linear(2, 3)
    recursive_setattr(model, "1.1", replacement)
    assert model[1][1] is replacement
    from zerorun.deepspeed.compression import helper

    with pytest.raises(UnsupportedFeature, match="model compression"):
        helper.convert_conv1d_to_linear(model, nn.Conv1d)


def test_clone_tensors_for_torch_save_copies_views_to_the_cpu():
    from zerorun.deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    flat = torch.arange(6.0)
    item = {"a": flat[:2], "b": [flat[2:4], (flat[4:], 7)], "c": "text"}
    copied = clone_tensors_for_torch_save(item)
    assert torch.equal(copied["a"], flat[:2]) and copied["a"].untyped_storage().nbytes() == 8
    assert copied["b"][1][1] == 7 and copied["c"] == "text" and isinstance(copied["b"][1], tuple)
    flat.zero_()
    assert copied["b"][0].tolist() == [2.0, 3.0]  # a copy, not a view


# -- config rules DeepSpeed applies ---------------------------------------------------------------
def test_disabled_feature_sections_are_ignored_with_a_note_enabled_ones_fail():
    config = load_config({"train_batch_size": 8, "hybrid_engine": {"enabled": False, "max_out_tokens": 512},
                          "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}}},
                          "curriculum_learning": {"enabled": False}}, environ={})
    for key in ("compression_training", "curriculum_learning"):
        assert f"{key}: disabled, so ignored (a DeepSpeed feature zerorun does not have)" in config.notes
    assert "hybrid_engine: disabled, so ignored" in config.notes  # one note, none for its options
    assert not [note for note in config.notes if note.startswith("hybrid_engine.")]
    with pytest.raises(ConfigError, match="curriculum_learning: is a DeepSpeed feature zerorun does not have"):
        load_config({"train_batch_size": 8, "curriculum_learning": {"enabled": True}}, environ={})
    with pytest.raises(ConfigError, match="compression_training"):
        load_config({"train_batch_size": 8, "compression_training": {
            "weight_quantization": {"shared_parameters": {"enabled": True}}}}, environ={})


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_param_below_stage3_is_ignored_with_a_note(stage):
    zero = {"stage": stage, "offload_param": {"device": "cpu", "pin_memory": True}}
    if stage > 0:  # DeepSpeed-Chat's --offload writes both
        zero["offload_optimizer"] = {"device": "cpu"}
    config = load_config({"train_batch_size": 8, "zero_optimization": zero}, environ={})
    assert config.zero.offload_param.device == "none"
    assert config.zero.offload_optimizer.device == ("cpu" if stage > 0 else "none")
    assert any(note.startswith("zero_optimization.offload_param: ignored below stage 3") for note in config.notes)
    at3 = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
                      environ={})
    assert at3.zero.offload_param.device == "cpu"


# -- engines --------------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(5, 7)
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


@pytest.mark.usefixtures("alone")
@pytest.mark.parametrize("stage", [0, 3])
def test_initialize_without_an_optimizer_gives_a_forward_only_engine(stage):
    model = Net()
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, config={"train_batch_size": 4, "zero_optimization": {"stage": stage}})
    assert optimizer is None and scheduler is None
    engine.eval()
    with torch.no_grad():
        assert torch.allclose(engine(x), want)
    with pytest.raises(UsageError, match="built without an optimizer"):
        engine.backward(engine(x).sum())
    with pytest.raises(UsageError, match="built without an optimizer"):
        engine.step()


@pytest.mark.usefixtures("alone")
def test_initialize_of_a_wholly_frozen_model():
    model = Net().requires_grad_(False)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config={"train_batch_size": 4,
                                                                        "zero_optimization": {"stage": 3}})
    assert optimizer is None
    with torch.no_grad():
        assert engine(torch.ones(2, 5)).shape == (2, 3)


@pytest.mark.usefixtures("alone")
def test_engine_config_reads_as_deepspeeds_dict_and_as_zeroruns_typed_config():
    given = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto", "train_batch_size": 4,
             "zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": "auto",
                                   "stage3_gather_16bit_weights_on_model_save": True},
             "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    engine, optimizer, _, _ = deepspeed.initialize(model=Net(), config=given)
    assert engine.config.get("zero_optimization", {}).get("stage") == 2  # Trainer's question
    assert engine.config["gradient_accumulation_steps"] == 2 and engine.config["train_batch_size"] == 4
    assert "stage3_prefetch_bucket_size" not in engine.config["zero_optimization"]
    assert engine.config["bf16"] == {"enabled": False} and engine.config["optimizer"]["type"] == "AdamW"
    assert engine.config.zero.stage == 2 and engine.config.batch.micro_batch_size == 2  # zerorun's view
    assert engine.zero_gather_16bit_weights_on_model_save() is True
    assert given["gradient_accumulation_steps"] == "auto"  # the caller's dict is not touched
    assert optimizer.overflow is False


@pytest.mark.usefixtures("alone")
def test_overflow_follows_skipped_steps_and_tput_timer_counts_epochs():
    engine, optimizer, _, _ = deepspeed.initialize(model=Net(), config={
        "train_batch_size": 4, "fp16": {"enabled": True, "initial_scale_power": 60},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
    x = torch.randn(4, 5)
    engine.backward(engine(x).float().sum())
    engine.step()
    assert not engine.was_step_applied() and optimizer.overflow is True  # 2^60 overflows fp16
    assert engine.zero_gather_16bit_weights_on_model_save() is False  # absent: DeepSpeed's default
    timer = engine.tput_timer
    assert timer is engine.tput_timer and timer.epoch_count == 0
    timer.update_epoch_count()
    assert timer.epoch_count == 1 and timer.avg_samples_per_sec() == 0.0
    engine.destroy()
