"""pytest tests/unit/test_engine_batches_and_config_precedence.py — one-process engine habits a newcomer tries first.

Nested bf16 batches, DeepSpeed schedulers from a config, the warnings when a script's config or
optimizer silently beats the config, and set_total_steps reaching the telemetry recorder.
"""

from __future__ import annotations

import json
import warnings
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

import zerorun
from zerorun.config import load_config
from zerorun.config.precedence import ConfigPrecedenceWarning
from zerorun.schedulers import WarmupDecayLR
from zerorun.zero.engine import _cast_floating

Batch = namedtuple("Batch", "x ids")


class TupleModel(nn.Module):
    """The README's loop: ``loss = engine(batch)`` with the batch a (inputs, targets) tuple."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(7, 3)

    def forward(self, batch):
        x, y = batch
        return ((self.linear(x).float() - y.float()) ** 2).mean()


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "ZERORUN_CONFIG", "ZERORUN_TELEMETRY_FD"):
        monkeypatch.delenv(name, raising=False)


def test_bf16_tuple_batch_trains():
    """Used to fail with 'mat1 and mat2 must have the same dtype'."""
    model = TupleModel()
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                {"precision": {"dtype": "bf16"}})
    loss = engine((torch.randn(4, 7), torch.randn(4, 3)))
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)


def test_cast_floating_recurses_and_leaves_integers():
    ids = torch.arange(4)
    value = {"a": (torch.ones(2), [torch.zeros(1), ids]), "b": Batch(torch.ones(1), ids),
             "c": OrderedDict(x=torch.ones(1)), "d": "text"}
    cast = _cast_floating(value, torch.bfloat16)
    assert cast["a"][0].dtype == torch.bfloat16 and cast["a"][1][0].dtype == torch.bfloat16
    assert cast["a"][1][1] is ids and isinstance(cast["a"][1], list)
    assert isinstance(cast["b"], Batch) and cast["b"].x.dtype == torch.bfloat16 and cast["b"].ids is ids
    assert isinstance(cast["c"], OrderedDict) and cast["c"]["x"].dtype == torch.bfloat16
    assert cast["d"] == "text"


def test_engine_builds_a_deepspeed_scheduler_from_a_deepspeed_config():
    model = nn.Linear(3, 1)
    config = {"train_batch_size": 1, "scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 10, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"}}}
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), config)
    assert isinstance(engine.lr_scheduler, WarmupDecayLR)
    assert engine.lr_scheduler.optimizer is engine.optimizer
    seen = []
    for _ in range(6):
        engine.backward(engine(torch.randn(1, 3)).sum())
        engine.step()
        seen.append(engine.optimizer.param_groups[0]["lr"])
    # iterations 0..5: linear warm-up over 4 steps, then (10 - it) / 6 of the max
    assert seen == pytest.approx([0.0, 0.0025, 0.005, 0.0075, 0.01 * 6 / 6, 0.01 * 5 / 6])


def test_script_config_beating_launcher_config_warns_naming_both(tmp_path, monkeypatch):
    launcher = tmp_path / "config.json"
    launcher.write_text(json.dumps({"zero": {"stage": 3}}))
    monkeypatch.setenv("ZERORUN_CONFIG", str(launcher))
    model = nn.Linear(3, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero": {"stage": 1}})
    assert engine.stage == 1
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigPrecedenceWarning)]
    assert len(messages) == 1
    assert "replaces the launcher's --config" in messages[0] and str(launcher) in messages[0]
    assert "zero.stage: script 1, --config 3" in messages[0]


def test_no_warning_when_the_script_leaves_the_config_to_the_launcher(tmp_path, monkeypatch):
    launcher = tmp_path / "config.json"
    launcher.write_text(json.dumps({"zero": {"stage": 1}}))
    monkeypatch.setenv("ZERORUN_CONFIG", str(launcher))
    model = nn.Linear(3, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not [w for w in caught if issubclass(w.category, ConfigPrecedenceWarning)]


def test_config_lr_ignored_by_the_scripts_optimizer_warns_once_naming_both():
    model = nn.Linear(3, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-4),
                                    {"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigPrecedenceWarning)]
    assert len(messages) == 1
    assert "optimizer.params.lr = 0.01" in messages[0] and "lr = 0.0003" in messages[0]
    assert engine.optimizer.param_groups[0]["lr"] == 3e-4


def test_config_lr_builds_the_optimizer_without_warning():
    model = nn.Linear(3, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = zerorun.initialize(model, None, {"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
    assert not [w for w in caught if issubclass(w.category, ConfigPrecedenceWarning)]
    assert engine.optimizer.param_groups[0]["lr"] == 0.01


def test_set_total_steps_reaches_the_step_messages():
    from zerorun.telemetry.recorder import Recorder

    class Sink:
        def __init__(self):
            self.lines = []

        def write(self, line):
            self.lines.append(json.loads(line))

    model = nn.Linear(3, 1)
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sink = Sink()
    engine._recorder = Recorder(sink, token="t", rank=0, host="h", world_size=1)
    engine.set_total_steps(40)
    engine.backward(engine(torch.randn(2, 3)).sum())
    engine.step()
    engine._recorder.send_sample()
    steps = [m for m in sink.lines if m["kind"] == "step"]
    assert steps and steps[0]["total_steps"] == 40
    with pytest.raises(zerorun.errors.UsageError):
        engine.set_total_steps(0)


def test_load_config_of_a_filled_in_dict_is_unchanged():
    data = {"train_batch_size": 8, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert load_config(data, environ={}).precision.dtype == "bf16"


def test_a_tuple_batch_counts_its_samples():
    import torch
    from torch import nn

    import zerorun

    model = nn.Linear(3, 1)
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    batch = (torch.randn(5, 3), torch.randn(5, 1))
    engine(batch[0]).sum()
    assert engine._window_samples == 5
    wrapper = nn.Module()
    wrapper.forward = lambda b: model(b[0])
    engine.module = wrapper
    engine(batch)
    assert engine._window_samples == 10


def test_a_launcher_config_left_at_its_defaults_is_not_warned_about(tmp_path, monkeypatch):
    """ZerorunTrainer under the launcher without --config: the launcher's config.json
    holds only defaults, so the script's config loses nothing and no warning is due."""
    from zerorun.config import load_config, to_dict

    launcher = tmp_path / "config.json"
    launcher.write_text(json.dumps(to_dict(load_config(None, environ={}, world_size=1))))
    monkeypatch.setenv("ZERORUN_CONFIG", str(launcher))
    model = nn.Linear(3, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01),
                           {"zero": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.01}}})
    assert not [w for w in caught if issubclass(w.category, ConfigPrecedenceWarning)]


def test_the_init_starter_runs_without_a_precedence_warning(tmp_path, monkeypatch):
    """``zerorun init``'s train.py and zerorun.yaml agree: the optimizer comes from the yaml."""
    import runpy
    import sys

    from zerorun.cli.init import planned_files, write_files

    write_files(planned_files("zero2", tmp_path, False), force=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ZERORUN_CONFIG", raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py", "--steps", "2"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runpy.run_path(str(tmp_path / "train.py"), run_name="__main__")
    assert not [w for w in caught if issubclass(w.category, ConfigPrecedenceWarning)]


def test_hang_timeout_beside_a_script_config_is_not_warned_about(tmp_path, monkeypatch):
    """``--hang-timeout 15`` sets telemetry.hang_timeout_s in the launcher's
    config, which only the launcher reads; a config dict in the script replaces none of it."""
    from zerorun.config import load_config, to_dict

    launcher = tmp_path / "config.json"
    launcher.write_text(json.dumps(to_dict(load_config(None, environ={}, world_size=1,
                                                       overrides={"telemetry.hang_timeout_s": 15.0}))))
    monkeypatch.setenv("ZERORUN_CONFIG", str(launcher))
    model = nn.Linear(3, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01), {"zero": {"stage": 2}})
    assert not [str(w.message) for w in caught if issubclass(w.category, ConfigPrecedenceWarning)]


def test_a_checkpoint_section_beside_deepspeed_keys_is_kept_and_its_deepspeed_keys_noted(tmp_path, capsys):
    """The whole section was one "has no effect" note, shown only for --config
    files, so a script's dict asking for checkpoints got none without a word."""
    model = nn.Linear(3, 1)
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01), {
        "train_micro_batch_size_per_gpu": 4,
        "checkpoint": {"dir": str(tmp_path / "ck"), "resume": True, "interval_steps": 1, "tag_validation": "Warn"}})
    assert engine.config.checkpoint.dir == str(tmp_path / "ck")
    assert engine.config.checkpoint.resume is True and engine.config.checkpoint.interval_steps == 1
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("zerorun: note: checkpoint.tag_validation: accepted;")]
    engine.backward(engine(torch.randn(4, 3)).pow(2).mean())
    engine.step()
    assert (tmp_path / "ck" / "global_step1" / "manifest.json").is_file()
