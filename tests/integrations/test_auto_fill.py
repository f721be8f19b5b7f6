"""pytest tests/integrations/test_auto_fill.py — "auto" config values filled from the training
arguments by transformers' DeepSpeed rules, and conflicts reported naming both sides.

No process group: the rules are pure (zerorun/integrations/hf_auto.py) and read the arguments
by attribute; one test builds real TrainingArguments so the attribute names are checked too.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from zerorun.errors import ConfigError
from zerorun.integrations.hf_auto import (
    AutoConfigMismatch,
    fill_from_args,
    fill_from_model,
    hidden_size_of,
    read_config,
    remaining_autos,
)


def arguments(**changes) -> SimpleNamespace:
    values = dict(
        world_size=4, per_device_train_batch_size=3, gradient_accumulation_steps=5, max_grad_norm=0.7,
        learning_rate=2e-4, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7, weight_decay=0.03,
        fp16=False, fp16_full_eval=False, bf16=False, bf16_full_eval=False,
    )
    values.update(changes)
    return SimpleNamespace(**values)


def nested(path: str, value) -> dict:
    *parents, leaf = path.split(".")
    out = node = {}
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return out


def get(config: dict, path: str):
    for part in path.split("."):
        config = config[part]
    return config


# (DeepSpeed key, the value the arguments above give it)
ARGUMENT_CASES = [
    ("train_micro_batch_size_per_gpu", 3),
    ("gradient_accumulation_steps", 5),
    ("train_batch_size", 4 * 3 * 5),
    ("gradient_clipping", 0.7),
    ("optimizer.params.lr", 2e-4),
    ("optimizer.params.betas", [0.8, 0.95]),
    ("optimizer.params.eps", 1e-7),
    ("optimizer.params.weight_decay", 0.03),
    ("scheduler.params.warmup_min_lr", 0),
    ("scheduler.params.warmup_max_lr", 2e-4),
    ("fp16.enabled", False),
    ("bf16.enabled", False),
]


@pytest.mark.parametrize("path,expected", ARGUMENT_CASES)
def test_each_argument_rule_fills_its_key(path, expected):
    config = {"zero_optimization": {"stage": 2}, **nested(path, "auto")}
    filled = fill_from_args(config, arguments())
    assert get(filled, path) == expected
    assert remaining_autos(filled) == []


@pytest.mark.parametrize("flags,fp16,bf16", [
    ({"fp16": True}, True, False), ({"bf16": True}, False, True),
    ({"fp16_full_eval": True}, True, False), ({"bf16_full_eval": True}, False, True),
])
def test_precision_flags_fill_enabled(flags, fp16, bf16):
    config = {"zero_optimization": {"stage": 1}, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}
    filled = fill_from_args(config, arguments(**flags))
    assert filled["fp16"]["enabled"] is fp16 and filled["bf16"]["enabled"] is bf16


@pytest.mark.parametrize("path,value,argument,argument_value", [
    ("train_micro_batch_size_per_gpu", 8, "per_device_train_batch_size", "3"),
    ("gradient_accumulation_steps", 1, "gradient_accumulation_steps", "5"),
    ("train_batch_size", 64, "train_batch_size (world_size x per_device_train_batch_size x "
                             "gradient_accumulation_steps)", "60"),
    ("gradient_clipping", 1.0, "max_grad_norm", "0.7"),
    ("optimizer.params.lr", 1e-3, "learning_rate", "0.0002"),
    ("optimizer.params.betas", [0.9, 0.999], "adam_beta1+adam_beta2", "[0.8, 0.95]"),
    ("optimizer.params.eps", 1e-8, "adam_epsilon", "1e-07"),
    ("optimizer.params.weight_decay", 0.0, "weight_decay", "0.03"),
    ("scheduler.params.warmup_max_lr", 1e-3, "learning_rate", "0.0002"),
    ("fp16.enabled", True, "fp16|fp16_full_eval", "False"),
])
def test_a_conflicting_value_is_an_error_naming_both(path, value, argument, argument_value):
    config = {"zero_optimization": {"stage": 2}, **nested(path, value)}
    with pytest.raises(AutoConfigMismatch) as caught:
        fill_from_args(config, arguments())
    message = str(caught.value)
    assert f"{path}={value!r}" in message
    assert f"TrainingArguments {argument}={argument_value}" in message
    assert "auto" in caught.value.hint


def test_equal_concrete_values_pass_and_every_conflict_is_listed_at_once():
    agreeing = {"gradient_accumulation_steps": 5, "gradient_clipping": 0.7, "optimizer": {
        "type": "AdamW", "params": {"betas": (0.8, 0.95), "lr": 2e-4}}}
    assert fill_from_args(agreeing, arguments()) == agreeing
    with pytest.raises(AutoConfigMismatch) as caught:
        fill_from_args({"gradient_accumulation_steps": 2, "gradient_clipping": 9.0}, arguments())
    assert "gradient_accumulation_steps=2" in str(caught.value) and "gradient_clipping=9.0" in str(caught.value)


def test_fill_only_values_never_conflict_and_absent_keys_stay_absent():
    config = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-6}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 123}}
    filled = fill_from_args(config, arguments())
    filled = fill_from_model(filled, arguments(), hidden_size=16, num_training_steps=10, warmup_steps=2)
    assert filled["scheduler"]["params"] == {"warmup_min_lr": 1e-6}
    assert filled["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 123}
    assert "gradient_clipping" not in filled  # transformers does not add it either


def test_the_input_is_not_modified():
    config = {"gradient_accumulation_steps": "auto"}
    fill_from_args(config, arguments())
    assert config == {"gradient_accumulation_steps": "auto"}


def test_bucket_sizes_come_from_the_hidden_size_and_stage3_keys_only_at_stage3():
    zero3 = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                   "stage3_param_persistence_threshold": "auto"}}
    filled = fill_from_model(zero3, arguments(), hidden_size=48, num_training_steps=1, warmup_steps=0)
    assert filled["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 48 * 48,
                                           "stage3_prefetch_bucket_size": int(0.9 * 48 * 48),
                                           "stage3_param_persistence_threshold": 480}
    zero2 = {"zero_optimization": {**zero3["zero_optimization"], "stage": 2}}
    filled = fill_from_model(zero2, arguments(), hidden_size=48, num_training_steps=1, warmup_steps=0)
    assert filled["zero_optimization"]["reduce_bucket_size"] == 48 * 48
    # As under transformers: left "auto" (zerorun's loader then applies its default, with a note).
    assert filled["zero_optimization"]["stage3_prefetch_bucket_size"] == "auto"


def test_scheduler_steps_come_from_the_step_count():
    config = {"zero_optimization": {"stage": 1},
              "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}}}
    filled = fill_from_model(config, arguments(), hidden_size=None, num_training_steps=40, warmup_steps=4)
    assert filled["scheduler"]["params"] == {"total_num_steps": 40, "warmup_num_steps": 4}
    # A warm-up of 0 steps becomes 1, as transformers keeps it for DeepSpeed.
    filled = fill_from_model(config, arguments(), hidden_size=None, num_training_steps=40, warmup_steps=0)
    assert filled["scheduler"]["params"]["warmup_num_steps"] == 1
    with pytest.raises(AutoConfigMismatch, match=r"total_num_steps=30 .* num_training_steps \(calculated\)=40"):
        fill_from_model({"zero_optimization": {"stage": 1},
                         "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 30}}}, arguments(),
                        hidden_size=None, num_training_steps=40, warmup_steps=4)


def test_auto_buckets_without_a_hidden_size_name_the_keys():
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
    with pytest.raises(ConfigError, match="zero_optimization.reduce_bucket_size"):
        fill_from_model(config, arguments(), hidden_size=None, num_training_steps=1, warmup_steps=0)


def test_hidden_size_lookup_order():
    assert hidden_size_of(SimpleNamespace(hidden_size=32)) == 32
    assert hidden_size_of(SimpleNamespace(hidden_sizes=[8, 64, 16])) == 64
    assert hidden_size_of(SimpleNamespace(text_config=SimpleNamespace(hidden_size=24))) == 24
    assert hidden_size_of(SimpleNamespace()) is None


def test_zerorun_format_uses_the_same_rules_on_its_own_keys():
    config = {"zero": {"stage": 3, "reduce_bucket_size": "auto", "prefetch_bucket_size": "auto"},
              "batch": {"micro_batch_size": "auto", "gradient_accumulation_steps": "auto"},
              "precision": {"dtype": "auto"}, "gradient_clipping": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}}
    filled = fill_from_args(config, arguments(bf16=True))
    filled = fill_from_model(filled, arguments(bf16=True), hidden_size=10, num_training_steps=5, warmup_steps=1)
    assert filled == {"zero": {"stage": 3, "reduce_bucket_size": 100, "prefetch_bucket_size": 90},
                      "batch": {"micro_batch_size": 3, "gradient_accumulation_steps": 5},
                      "precision": {"dtype": "bf16"}, "gradient_clipping": 0.7,
                      "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.8, 0.95]}}}
    with pytest.raises(AutoConfigMismatch, match=r"precision.dtype='fp16' .* bf16\|fp16 \(fp32 when neither\)='fp32'"):
        fill_from_args({"precision": {"dtype": "fp16"}}, arguments())


def test_the_filled_config_loads_in_zerorun():
    from zerorun.config import load_config

    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
    filled = fill_from_model(fill_from_args(config, arguments(bf16=True)), arguments(bf16=True),
                             hidden_size=8, num_training_steps=3, warmup_steps=0)
    loaded = load_config(filled, world_size=4)
    assert (loaded.batch.micro_batch_size, loaded.gradient_accumulation_steps, loaded.batch.train_batch_size) == (3, 5, 60)
    assert loaded.gradient_clipping == 0.7 and loaded.precision.dtype == "bf16"
    assert (loaded.zero.reduce_bucket_size, loaded.zero.param_persistence_threshold) == (64, 80)
    assert loaded.optimizer.params == {"lr": 2e-4, "weight_decay": 0.03}


def test_read_config_takes_paths_inline_json_and_dicts(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": "auto"}))
    yaml_path = tmp_path / "z.yaml"
    yaml_path.write_text("zero:\n  stage: 2\n")
    assert read_config(path) == read_config(str(path)) == {"gradient_accumulation_steps": "auto"}
    assert read_config(yaml_path) == {"zero": {"stage": 2}}
    assert read_config('{"zero": {"stage": 1}}') == {"zero": {"stage": 1}}
    with pytest.raises(ConfigError, match="does not exist"):
        read_config(tmp_path / "missing.json")


# -- with transformers: the real argument names, and --zerorun on the command line --------------
def test_training_arguments_fill_and_conflict(tmp_path):
    pytest.importorskip("transformers", minversion="5.23")
    pytest.importorskip("accelerate")
    from transformers import HfArgumentParser

    from zerorun.integrations.hf import ZerorunTrainingArguments

    config_path = tmp_path / "ds_config.json"
    config_path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}}}))
    parser = HfArgumentParser((ZerorunTrainingArguments,))
    (args,) = parser.parse_args_into_dataclasses([
        "--output_dir", str(tmp_path / "out"), "--use_cpu", "--report_to", "none", "--zerorun", str(config_path),
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "3", "--max_grad_norm", "0.5",
        "--learning_rate", "1e-3", "--adam_beta2", "0.99", "--weight_decay", "0.1"])
    assert args.zerorun_config == {
        "train_micro_batch_size_per_gpu": 4, "train_batch_size": 12, "gradient_accumulation_steps": 3,
        "gradient_clipping": 0.5, "bf16": {"enabled": False}, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "eps": 1e-8,
                                                  "weight_decay": 0.1}}}
    with pytest.raises(AutoConfigMismatch, match=r"gradient_accumulation_steps=8 .* gradient_accumulation_steps=3"):
        ZerorunTrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none",
                                 gradient_accumulation_steps=3, zerorun={"gradient_accumulation_steps": 8})


def test_deepspeeds_own_scheduler_is_accepted_and_its_autos_filled(tmp_path):
    pytest.importorskip("transformers", minversion="5.23")
    pytest.importorskip("accelerate")
    from zerorun.integrations.hf import ZerorunTrainingArguments

    config = {"zero_optimization": {"stage": 2},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto"}}}
    args = ZerorunTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", zerorun=config,
                                    learning_rate=3e-4, warmup_steps=7)
    params = args.zerorun_config["scheduler"]["params"]
    assert params["warmup_max_lr"] == 3e-4 and params["warmup_num_steps"] in (7, "auto")
