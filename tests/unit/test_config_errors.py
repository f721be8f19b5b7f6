"""pytest tests/unit/test_config_errors.py — one test per class of config error, each with its exact message."""

from __future__ import annotations

import pytest

from zerorun.config import load_config
from zerorun.errors import ConfigError


def problems(source, **kwargs) -> list[str]:
    """The problem lines of the ConfigError that loading ``source`` raises."""
    kwargs.setdefault("environ", {})
    with pytest.raises(ConfigError) as info:
        load_config(source, **kwargs)
    summary, *lines = str(info.value).splitlines()
    assert summary.startswith("invalid config ")
    if not lines:  # one problem is one line: "invalid config SOURCE: PROBLEM"
        return [summary.split(": ", 1)[1]]
    assert summary.endswith(f": {len(lines)} problems")
    assert all(line.startswith("  - ") for line in lines)
    return [line[4:] for line in lines]


def test_unknown_key_suggests_the_closest_one():
    assert problems({"zero": {"stgae": 2}}) == ["zero.stgae: unknown key (did you mean 'stage'?)"]


def test_unknown_key_without_a_close_match_lists_the_valid_keys():
    assert problems({"batch": {"xyz": 1}}) == [
        "batch.xyz: unknown key; valid keys here: gradient_accumulation_steps, micro_batch_size, "
        "train_batch_size"
    ]


def test_wrong_types_name_the_expected_type():
    assert problems({"zero": {"stage": "two", "overlap_comm": 1}, "gradient_clipping": [1]}) == [
        "zero.stage = 'two': must be an integer, got a string",
        "zero.overlap_comm = 1: must be true or false, got an integer",
        "gradient_clipping = [1]: must be a number, got a list",
    ]


def test_fractional_value_for_an_integer_key():
    assert problems({"zero": {"reduce_bucket_size": 2.5}}) == [
        "zero.reduce_bucket_size = 2.5: must be an integer, got a fractional number"
    ]


def test_choice_keys_suggest_the_closest_choice():
    assert problems({"precision": {"dtype": "bf61"}}) == [
        "precision.dtype = 'bf61': must be one of 'fp32', 'bf16', 'fp16' (did you mean 'bf16'?)"
    ]


def test_null_for_a_required_key_and_a_section_that_is_not_a_mapping():
    assert problems({"zero": {"stage": None}, "telemetry": 3}) == [
        "zero.stage = null: must be an integer, not null",
        "telemetry = 3: must be a mapping of keys to values, got an integer",
    ]


def test_out_of_range_values():
    assert problems({"zero": {"stage": 5, "reduce_bucket_size": -1},
                     "batch": {"micro_batch_size": 0}, "precision": {"min_loss_scale": 0}}) == [
        "zero.stage = 5: must be a ZeRO stage: 0, 1, 2 or 3",
        "zero.reduce_bucket_size = -1: must be between 1 and 1099511627776",
        "precision.min_loss_scale = 0.0: must be greater than 0",
        "batch.micro_batch_size = 0: must be at least 1",
    ]


def test_parameter_offload_below_stage_3():
    assert problems({"zero": {"stage": 2, "offload_param": {"device": "cpu"}}}) == [
        "zero.offload_param.device = 'cpu': parameter offload needs ZeRO stage 3 (stage is 2); "
        "set zero.stage: 3 or offload_param.device: none"
    ]


def test_a_turn_window_without_a_prefetch_budget():
    load_config({"zero": {"stage": 3, "prefetch_bucket_size": 10, "turn_prefetch_bucket_size": 20}}, environ={})
    assert problems({"zero": {"stage": 3, "turn_prefetch_bucket_size": 20}}) == [
        "zero.turn_prefetch_bucket_size = 20: the gathers at the turn into backward extend stage 3's prefetch "
        "budget, which is 0; set zero.prefetch_bucket_size too, or remove turn_prefetch_bucket_size"
    ]


def test_tied_embedding_rows_below_stage_3():
    load_config({"zero": {"stage": 3, "tied_embedding_rows": True}}, environ={})
    assert problems({"zero": {"stage": 2, "tied_embedding_rows": True}}) == [
        "zero.tied_embedding_rows = true: a tied embedding's rows replace the gathers and reduce-scatters of "
        "stage 3's partitioned table (stage is 2); set zero.stage: 3 or tied_embedding_rows: false"
    ]


def test_optimizer_offload_at_stage_0():
    assert problems({"zero": {"offload_optimizer": {"device": "cpu"}}}) == [
        "zero.offload_optimizer.device = 'cpu': optimizer offload needs ZeRO stage 1, 2 or 3 "
        "(stage is 0); raise zero.stage or set offload_optimizer.device: none"
    ]


def test_nvme_offload_without_a_path():
    assert problems({"zero": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}) == [
        "zero.offload_optimizer.nvme_path = null: NVMe offload needs a directory on a fast local "
        "disk; set zero.offload_optimizer.nvme_path"
    ]


def test_parameter_offload_to_nvme_needs_a_path_and_stage_3():
    load_config({"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}}, environ={})
    assert problems({"zero": {"stage": 3, "offload_param": {"device": "nvme"}}}) == [
        "zero.offload_param.nvme_path = null: NVMe offload needs a directory on a fast local "
        "disk; set zero.offload_param.nvme_path"]


def test_checkpoint_interval_without_a_directory():
    assert problems({"checkpoint": {"interval_steps": 100}}) == [
        "checkpoint.dir = null: checkpoint.interval_steps is 100 but there is no directory to "
        "write to; set checkpoint.dir"
    ]


def test_fp16_and_bf16_both_enabled_in_deepspeed_form():
    assert problems({"fp16": {"enabled": True}, "bf16": {"enabled": True}}) == [
        "fp16.enabled = true: fp16 and bf16 are both enabled; enable only one of them"
    ]


def test_unknown_optimizer_and_scheduler_names_are_checked_against_torch():
    found = problems({"optimizer": {"type": "Adamw"}, "scheduler": {"type": "CosineAnealingLR"}})
    assert found[0].startswith("optimizer.type = 'Adamw': not a class in torch.optim "
                               "(did you mean 'AdamW'?); choose one of ")
    assert "SGD" in found[0]
    assert found[1].startswith("scheduler.type = 'CosineAnealingLR': not a class in "
                               "torch.optim.lr_scheduler (did you mean 'CosineAnnealingLR'?)")
    assert len(found) == 2


def test_optimizer_arguments_are_checked_against_the_class_signature():
    assert problems({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentun": 0.9}}}) == [
        "optimizer.params.momentun: torch.optim.SGD takes no such argument (did you mean "
        "'momentum'?); it accepts lr, momentum, dampening, weight_decay, nesterov, maximize, "
        "foreach, differentiable, fused"
    ]


def test_auto_is_rejected_in_the_zerorun_format():
    assert problems({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}) == [
        "optimizer.params.lr = 'auto': 'auto' is a Hugging Face Trainer placeholder; give a "
        "value or remove the key to use torch's default"
    ]


def test_batch_rule_mismatch_with_the_world_size():
    batch = {"batch": {"train_batch_size": 64, "micro_batch_size": 4, "gradient_accumulation_steps": 4}}
    assert problems(batch, world_size=2) == [
        "batch.train_batch_size = 64: must equal micro_batch_size x gradient_accumulation_steps x "
        "world_size = 4 x 4 x 2 = 32; fix one of them or leave one out to have it derived"
    ]


def test_batch_that_cannot_be_split_over_the_ranks():
    assert problems({"batch": {"train_batch_size": 64, "gradient_accumulation_steps": 2}}, world_size=3) == [
        "batch.train_batch_size = 64: cannot be split evenly over 3 ranks x 2 accumulation steps "
        "(train_batch_size=64, micro_batch_size=None, gradient_accumulation_steps=2); make it a "
        "multiple of 6"
    ]


def test_batch_triple_that_fits_no_world_size():
    assert problems({"batch": {"train_batch_size": 10, "micro_batch_size": 4,
                               "gradient_accumulation_steps": 1}}) == [
        "batch.train_batch_size = 10: is not a multiple of micro_batch_size x "
        "gradient_accumulation_steps = 4, so no world size fits; adjust one of them"
    ]


def test_deepspeed_misspelt_key_names_the_deepspeed_path():
    assert problems({"zero_optimization": {"stgae": 2}}) == [
        "zero_optimization.stgae: unknown DeepSpeed key (did you mean 'stage'?)"
    ]


def test_deepspeed_bad_value_names_both_keys():
    assert problems({"zero_optimization": {"stage": 4}}) == [
        "zero_optimization.stage (zerorun key zero.stage) = 4: must be a ZeRO stage: 0, 1, 2 or 3"
    ]


def test_deepspeed_unsupported_features_are_named():
    assert problems({"train_batch_size": 8, "pipeline": {"stages": 2},
                     "zero_optimization": {"mics_shard_size": 2}}) == [
        "pipeline: is a DeepSpeed feature zerorun does not have; remove this section",
        "zero_optimization.mics_shard_size = 2: not supported: MiCS sharding is not supported; remove it",
    ]


def test_deepspeed_scheduler_is_accepted_and_its_params_checked():
    assert load_config({"train_batch_size": 8, "scheduler": {"type": "WarmupLR"}}, environ={}).scheduler.type == "WarmupLR"
    assert problems({"train_batch_size": 8, "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0}}}) == [
        "scheduler.params.cycle_max_lr: zerorun.schedulers.OneCycle needs this argument"
    ]


def test_deepspeed_only_optimizer():
    assert problems({"train_batch_size": 8, "optimizer": {"type": "OneBitAdam", "params": {}}}) == [
        "optimizer.type = 'OneBitAdam': is a DeepSpeed-only optimizer; use a torch.optim class "
        "such as AdamW, Adam or SGD"
    ]


def test_mixed_formats_are_rejected():
    assert problems({"train_batch_size": 8, "zero": {"stage": 2}}) == [
        "zero: is a zerorun key in a DeepSpeed config; write the whole file in one format "
        "(see docs/config.md for the mapping)"
    ]


def test_environment_variable_naming_no_key():
    assert problems(None, environ={"ZERORUN_ZERO__STGAE": "3"}) == [
        "environment ZERORUN_ZERO__STGAE: names no config key (did you mean 'zero.stage'?); the "
        "form is ZERORUN_<SECTION>__<KEY>, e.g. ZERORUN_ZERO__STAGE"
    ]


def test_bad_environment_value_is_reported_under_its_key():
    assert problems(None, environ={"ZERORUN_ZERO__STAGE": "three"}) == [
        "zero.stage = 'three': must be an integer, got a string"
    ]


def test_override_naming_no_key():
    assert problems(None, overrides={"zero.stgae": 3}) == [
        "override zero.stgae: names no config key (did you mean 'zero.stage'?)"
    ]


def test_every_problem_is_listed_at_once():
    found = problems({"zero": {"stgae": 2, "stage": 7}, "precision": {"dtype": "fp8"},
                      "batch": {"micro_batch_size": -2}, "seed": "x"})
    assert [line.split(":")[0].split(" ")[0] for line in found] == [
        "zero.stgae", "precision.dtype", "seed", "zero.stage", "batch.micro_batch_size"]


def test_non_json_values_in_params_are_rejected():
    assert problems({"optimizer": {"type": "SGD", "params": {"lr": {1, 2}}}}) == [
        "optimizer.params = {'lr': {1, 2}}: may hold only strings, finite numbers, booleans, null, "
        "lists and mappings (nested at most 8 deep)"
    ]


@pytest.mark.parametrize("world_size", [0, -1, 2.0, True, "2"])
def test_invalid_world_size(world_size):
    with pytest.raises(ConfigError, match="world size must be a positive integer"):
        load_config(None, world_size=world_size)


@pytest.mark.parametrize("source, message", [
    (3, "a config must be a file path, a dict or a ZerorunConfig, not int"),
    ([1], "a config must be a file path, a dict or a ZerorunConfig, not list"),
])
def test_invalid_source_types(source, message):
    with pytest.raises(ConfigError) as info:
        load_config(source)
    assert str(info.value) == message


def test_file_errors(tmp_path):
    cases = {
        "missing.yaml": (None, "config file '{p}' does not exist"),
        "config.toml": ("a = 1", "config file '{p}' must end in .yaml, .yml or .json"),
        "bad.yaml": ("zero: [1, 2\n", "config file '{p}' is not valid YAML: expected ',' or ']', "
                     "but got '<stream end>' at line 2 column 1"),
        "bad.json": ('{"zero": }', "config file '{p}' is not valid JSON: Expecting value at line 1 column 10"),
        "list.yml": ("- 1\n- 2\n", "config file '{p}' must hold a mapping of keys to values at the top, not [1, 2]"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert str(info.value) == message.format(p=path), name
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        load_config(tmp_path / "d.yaml")


def test_a_huge_value_is_shown_without_rendering_it_whole():
    import time

    from zerorun.config.problems import show

    nested = [list(range(10))] * 10
    for _ in range(6):
        nested = [nested] * 10  # 10^8 leaves, as an alias bomb would expand to
    started = time.perf_counter()
    text = show(nested)
    assert time.perf_counter() - started < 0.5 and len(text) <= 60 and text.startswith("[[[[")
    assert show({"a": 1}) == "{'a': 1}" and show((1, 2)) == "(1, 2)" and show("x" * 100).endswith("...")
