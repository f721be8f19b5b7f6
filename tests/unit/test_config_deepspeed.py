"""pytest tests/unit/test_config_deepspeed.py — DeepSpeed JSON configs: the two seed configs, the key mapping, notes, "auto" values."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerorun.config import (
    BatchConfig, OffloadConfig, OptimizerConfig, SchedulerConfig, ZeroConfig, load_config, to_dict,
)
from zerorun.config.deepspeed import DEEPSPEED_MARKERS, TOP_LEVEL, looks_like_deepspeed
from zerorun.errors import ConfigError

DATA = Path(__file__).resolve().parents[1] / "data"


def test_seed_000_zero2_fp16_gives_the_intended_settings():
    config = load_config(DATA / "ds_zero2_fp16.json", world_size=2, environ={})
    assert config.zero.stage == 2
    assert config.zero.overlap_comm is True
    assert config.zero.reduce_bucket_size == 500_000_000  # written 5e8 in the JSON
    assert config.zero.allgather_bucket_size == 500_000_000
    assert config.precision.dtype == "fp16"
    assert config.precision.loss_scale == 0.0  # dynamic
    assert config.precision.initial_scale_power == 16
    # train 64 = micro x 2 accumulation x 2 ranks
    assert config.batch == BatchConfig(train_batch_size=64, micro_batch_size=16, gradient_accumulation_steps=2)
    assert config.zero.offload_optimizer == OffloadConfig() and config.zero.offload_param == OffloadConfig()
    # The harmless keys are accepted, each with a note saying it has no effect here.
    noted = sorted(note.split(":")[0] for note in config.notes)
    assert noted == ["steps_per_print", "wall_clock_breakdown", "zero_optimization.contiguous_gradients",
                     "zero_optimization.reduce_scatter"]


def test_seed_004_zero3_offload_gives_the_intended_settings():
    config = load_config(DATA / "ds_zero3_offload_fp16.json", world_size=8, environ={})
    assert config.zero.stage == 3
    assert config.zero.offload_optimizer == OffloadConfig(device="cpu", pin_memory=True)
    assert config.zero.offload_param == OffloadConfig(device="cpu", pin_memory=True)
    assert config.zero.reduce_bucket_size == 500_000_000
    assert config.zero.prefetch_bucket_size == 500_000_000
    assert config.zero.param_persistence_threshold == 1_000_000
    assert config.zero.allgather_bucket_size == ZeroConfig().allgather_bucket_size  # not set: default
    assert config.gradient_clipping == 1.0
    assert config.precision.dtype == "fp16" and config.precision.initial_scale_power == 16
    assert config.batch == BatchConfig(train_batch_size=256, micro_batch_size=2, gradient_accumulation_steps=16)
    assert [note.split(":")[0] for note in config.notes] == ["zero_optimization.contiguous_gradients"]


def test_stage3_max_live_parameters_is_read_with_deepspeeds_meaning(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, '
                    '"stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 5e7}}')
    config = load_config(path, world_size=2, environ={})
    assert (config.zero.max_live_parameters, config.zero.prefetch_bucket_size) == (30_000_000, 50_000_000)
    assert not config.notes  # no longer "no effect"


def test_seed_configs_need_a_world_size_that_divides_the_batch():
    with pytest.raises(ConfigError, match=r"cannot be split evenly over 3 ranks x 2 accumulation"):
        load_config(DATA / "ds_zero2_fp16.json", world_size=3, environ={})
    with pytest.raises(ConfigError, match=r"cannot be split evenly over 3 ranks x 16 accumulation"):
        load_config(DATA / "ds_zero3_offload_fp16.json", world_size=3, environ={})


def test_seed_configs_round_trip_as_zerorun_dicts():
    for name in ("ds_zero2_fp16.json", "ds_zero3_offload_fp16.json"):
        config = load_config(DATA / name, world_size=2, environ={})
        assert load_config(to_dict(config), world_size=2, environ={}) == config


def test_bf16_and_legacy_bfloat16_sections():
    assert load_config({"bf16": {"enabled": True}}, environ={}).precision.dtype == "bf16"
    assert load_config({"bfloat16": {"enabled": True}}, environ={}).precision.dtype == "bf16"
    assert load_config({"fp16": {"loss_scale": 128}}, environ={}).precision.dtype == "fp32"  # not enabled


def test_optimizer_names_follow_deepspeed_semantics():
    adam = load_config({"optimizer": {"type": "Adam", "params": {"lr": 3e-4, "weight_decay": 0.1}},
                        "train_batch_size": 8}, environ={})
    # DeepSpeed's "Adam" decouples weight decay (adam_w_mode defaults to true): torch's AdamW.
    assert adam.optimizer == OptimizerConfig(type="AdamW", params={"lr": 3e-4, "weight_decay": 0.1})
    assert any("runs as torch.optim.AdamW" in note for note in adam.notes)
    plain = load_config({"optimizer": {"type": "adam", "params": {"adam_w_mode": False, "lr": 1e-3}},
                         "train_batch_size": 8}, environ={})
    assert plain.optimizer == OptimizerConfig(type="Adam", params={"lr": 1e-3, "weight_decay": 0.0})
    sgd = load_config({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                       "train_batch_size": 8}, environ={})
    assert sgd.optimizer == OptimizerConfig(type="SGD", params={"lr": 0.1, "momentum": 0.9})


def test_auto_batch_sizes_are_derived():
    config = load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto",
                          "gradient_accumulation_steps": "auto"}, world_size=2, environ={})
    assert config.batch == BatchConfig(train_batch_size=16, micro_batch_size=8, gradient_accumulation_steps=1)
    assert sum("'auto' derived" in note for note in config.notes) == 2


def test_auto_outside_the_hf_integration_is_an_error_naming_each_key():
    """bf16.enabled: auto used to train in fp32 without a word; now every non-batch 'auto' is named."""
    with pytest.raises(ConfigError) as caught:
        load_config({
            "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
        }, world_size=2, environ={})
    message = caught.value.message
    assert "4 problems" in message
    assert "bf16.enabled = 'auto'" in message and "set it to true or false" in message
    assert "Hugging Face integration" in message
    for key in ("gradient_clipping", "optimizer.params.lr", "scheduler.params.warmup_max_lr"):
        assert f"{key} = 'auto'" in message
    assert "train_batch_size" not in message
    assert "reduce_bucket_size" not in message  # DeepSpeed's rule: its default applies (next test)


def test_auto_left_in_zero_optimization_takes_the_default_with_a_note():
    """DeepSpeed's config models drop an "auto" field, so Hugging Face's config, whose stage-3
    keys Trainer fills only at stage 3, runs at stage 2; zerorun reads it the same way."""
    default = load_config({"zero_optimization": {"stage": 2}}, environ={}).zero
    config = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "offload_optimizer": {"device": "auto"}}}, environ={})
    assert config.zero == default
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                "offload_optimizer.device"):
        assert sum(f"zero_optimization.{key}: 'auto' was not filled in" in n for n in config.notes) == 1


def test_a_dict_without_auto_loads_as_before():
    """The HF integration fills every 'auto' before load_config: such a dict must load unchanged."""
    config = load_config({"train_batch_size": 8, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
                          "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}}, environ={})
    assert config.precision.dtype == "bf16" and config.zero == ZeroConfig(stage=2, reduce_bucket_size=1000)
    assert config.gradient_clipping == 1.0


@pytest.mark.parametrize("name, params", [
    ("WarmupLR", {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 100}),
    ("WarmupDecayLR", {"total_num_steps": 1000, "warmup_num_steps": 100, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 1000, "warmup_min_ratio": 0.1}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 50}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-5, "lr_range_test_staircase": True}),
])
def test_deepspeed_schedulers_load_with_their_params(name, params):
    config = load_config({"train_batch_size": 8, "scheduler": {"type": name, "params": params}}, environ={})
    assert config.scheduler == SchedulerConfig(type=name, params=params)


def test_deepspeed_scheduler_missing_or_misspelt_params_are_named():
    with pytest.raises(ConfigError) as caught:
        load_config({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR",
                                                          "params": {"warmup_num_step": 10}}}, environ={})
    message = caught.value.message
    assert "scheduler.params.total_num_steps: zerorun.schedulers.WarmupDecayLR needs this argument" in message
    assert "scheduler.params.warmup_num_step: zerorun.schedulers.WarmupDecayLR takes no such argument" in message


def test_offload_details_and_legacy_cpu_offload():
    config = load_config({"zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4, "ratio": 1.0},
        "offload_param": {"device": "none", "max_in_cpu": 1e9},
    }}, environ={})
    assert config.zero.offload_optimizer == OffloadConfig(device="nvme", nvme_path="/local_nvme")
    assert config.zero.offload_param.device == "none"
    legacy = load_config({"zero_optimization": {"stage": 2, "cpu_offload": True}}, environ={})
    assert legacy.zero.offload_optimizer.device == "cpu"
    with pytest.raises(ConfigError, match=r"offload_optimizer.ratio = 0.3: not supported: partial"):
        load_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
                    environ={})


def test_combination_errors_name_the_deepspeed_keys():
    with pytest.raises(ConfigError) as info:
        load_config({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, environ={})
    assert ("zero_optimization.offload_optimizer.device (zerorun key zero.offload_optimizer.device) = 'cpu': "
            "optimizer offload needs ZeRO stage 1, 2 or 3") in str(info.value)
    # (offload_param below stage 3 is no error: DeepSpeed ignores it there, and so does zerorun,
    # with a note; tests/unit/test_deepspeed_surface.py)


def test_harmless_key_with_a_harmful_value_is_an_error():
    with pytest.raises(ConfigError, match=r"prescale_gradients = true: not supported"):
        load_config({"train_batch_size": 8, "prescale_gradients": True}, environ={})
    notes = load_config({"train_batch_size": 8, "prescale_gradients": False}, environ={}).notes
    assert notes == ["prescale_gradients: accepted; zerorun averages gradients after reduction; remove it"]


def test_format_detection():
    assert looks_like_deepspeed({"zero_optimization": {}})
    assert looks_like_deepspeed({"train_micro_batch_size_per_gpu": 1})
    assert not looks_like_deepspeed({"zero": {}, "optimizer": {"type": "SGD"}})
    assert not looks_like_deepspeed({"optimizer": {}, "scheduler": {}, "gradient_clipping": 1.0})
    assert DEEPSPEED_MARKERS <= set(TOP_LEVEL)


def test_every_deepspeed_key_is_accounted_for():
    """No DeepSpeed key is ignored silently: each one maps, notes or errors."""
    from zerorun.config.deepspeed import HANDLED, Map, Note, Section, Unsupported

    def walk(spec):
        for key, rule in spec.items():
            assert isinstance(rule, (Map, Note, Section, Unsupported)) or rule is HANDLED, key
            if isinstance(rule, Section):
                walk(rule.spec)

    walk(TOP_LEVEL)


def test_docs_name_every_deepspeed_key():
    from zerorun.config.deepspeed import Section

    docs = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()

    def keys(spec):
        for key, rule in spec.items():
            yield key
            if isinstance(rule, Section):
                yield from keys(rule.spec)

    missing = sorted({key for key in keys(TOP_LEVEL) if key != "enabled" and key not in docs})
    assert missing == []


@pytest.mark.parametrize("section", ["optimizer", "scheduler"])
def test_a_type_that_is_not_a_name_is_a_config_error(section):
    # A mapping as the type once reached a dict lookup and raised TypeError (a traceback).
    with pytest.raises(ConfigError, match=rf"{section}\.type = \{{\}}: must name"):
        load_config({"train_batch_size": 8, section: {"type": {}, "params": {}}})


# -- what DeepSpeed ignores (Note [ignored top-level keys] in zerorun/config/deepspeed.py) -------
def test_trl_dotted_top_level_keys_are_ignored_with_a_note_as_deepspeed_ignores_them():
    # What TRL 1.16's prepare_deepspeed hands deepspeed.initialize for a DPO reference model at
    # stage 3 (hidden size 16): the dotted names sit beside the section they seem to set.
    config = load_config({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000},
        "zero_optimization.reduce_bucket_size": 256,
        "zero_optimization.stage3_param_persistence_threshold": 160,
        "zero_optimization.stage3_prefetch_bucket_size": 230.4,
    }, world_size=2, environ={})
    # DeepSpeed applies none of them, and neither does zerorun: the nested value stands.
    assert config.zero.reduce_bucket_size == 1000
    assert config.zero.prefetch_bucket_size == ZeroConfig().prefetch_bucket_size
    assert config.zero.param_persistence_threshold == ZeroConfig().param_persistence_threshold
    for name in ("reduce_bucket_size", "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size"):
        assert (f"'zero_optimization.{name}' (a dotted name at the top level): ignored, as DeepSpeed "
                "ignores it; DeepSpeed reads only the nested key, inside 'zero_optimization'") in config.notes


def test_a_top_level_key_deepspeed_does_not_read_is_a_note_a_near_miss_or_a_key_it_acts_on_an_error():
    notes = load_config({"train_batch_size": 8, "model_card": {"name": "tiny"}}, environ={}).notes
    assert notes == ["'model_card': not a key DeepSpeed reads; ignored, as DeepSpeed ignores it"]
    with pytest.raises(ConfigError, match=r"gradient_clippng: unknown DeepSpeed key \(did you mean 'gradient_clipping'\?\)"):
        load_config({"train_batch_size": 8, "gradient_clippng": 1.0}, environ={})
    with pytest.raises(ConfigError, match="gradient_allreduce_op: a DeepSpeed key zerorun does not handle"):
        load_config({"train_batch_size": 8, "gradient_allreduce_op": "sum"}, environ={})
    # Inside a section DeepSpeed's models refuse extra fields, and so does zerorun.
    with pytest.raises(ConfigError, match=r"zero_optimization.stgae: unknown DeepSpeed key"):
        load_config({"zero_optimization": {"stgae": 2}}, environ={})


def test_hybrid_engine_enabled_is_accepted_with_notes():
    # What DeepSpeed-Chat's get_train_ds_config writes for step 3 with --enable_hybrid_engine.
    section = {"enabled": True, "max_out_tokens": 512, "inference_tp_size": 1, "release_inference_cache": False,
               "pin_parameters": True, "tp_gather_partition_size": 8}
    config = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2}, "hybrid_engine": section},
                         environ={})
    assert config.zero.stage == 2
    assert ("hybrid_engine.enabled: accepted; generate() runs the training model's own forward (stage 3 "
            "gathers parameters as in training); DeepSpeed's inference kernels are not used") in config.notes
    for key in ("max_out_tokens", "inference_tp_size", "pin_parameters", "tp_gather_partition_size"):
        assert (f"hybrid_engine.{key}: accepted; an inference-kernel option of DeepSpeed's hybrid engine; "
                "has no effect in zerorun") in config.notes
    with pytest.raises(ConfigError, match=r"hybrid_engine.max_out_token: unknown DeepSpeed key \(did you mean"):
        load_config({"train_batch_size": 8, "hybrid_engine": {"enabled": True, "max_out_token": 5}}, environ={})
