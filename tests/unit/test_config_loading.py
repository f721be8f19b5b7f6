"""pytest tests/unit/test_config_loading.py — sources, precedence (CLI > env > file > defaults), batch rule, round trip."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from zerorun.config import (
    BatchConfig,
    OffloadConfig,
    OptimizerConfig,
    PrecisionConfig,
    ZeroConfig,
    ZerorunConfig,
    config_env_names,
    load_config,
    parse_settings,
    to_dict,
)
from zerorun.config.build import convert, field_paths
from zerorun.config.problems import Problems
from zerorun.config.rules import RANGES, resolve_batch
from zerorun.errors import ConfigError


def test_defaults_come_from_the_schema():
    config = load_config(None, environ={})
    assert config == ZerorunConfig()
    assert config.zero.stage == 0 and config.precision.dtype == "fp32"
    assert config.notes == []


def test_yaml_json_dict_and_object_sources_agree(tmp_path):
    data = {"zero": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "precision": {"dtype": "bf16"}, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "c.yml").write_text(yaml.safe_dump(data))
    (tmp_path / "c.json").write_text(json.dumps(data))
    from_dict = load_config(data, environ={})
    assert from_dict.zero.stage == 2
    assert from_dict.zero.offload_optimizer == OffloadConfig(device="cpu")
    assert from_dict.optimizer == OptimizerConfig(type="AdamW", params={"lr": 0.001})
    for source in (tmp_path / "c.yaml", str(tmp_path / "c.yml"), tmp_path / "c.json", from_dict):
        assert load_config(source, environ={}) == from_dict


def test_empty_yaml_file_means_defaults(tmp_path):
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    config = load_config(tmp_path / "empty.yaml", environ={})
    assert config == ZerorunConfig()
    # Issue 31 item 20: said once (the launcher prints the notes), never silently.
    assert config.notes == [f"config file {str(tmp_path / 'empty.yaml')!r} is empty: the defaults apply"]


def test_yaml_quirks_are_read_as_users_mean_them():
    # PyYAML reads 5e8 as a string; users mean the number. Choice values are case-insensitive.
    config = load_config({"zero": {"reduce_bucket_size": "5e8"}, "precision": {"dtype": "BF16"},
                          "gradient_clipping": 1}, environ={})
    assert config.zero.reduce_bucket_size == 500_000_000
    assert isinstance(config.zero.reduce_bucket_size, int)
    assert config.precision.dtype == "bf16"
    assert config.gradient_clipping == 1.0 and isinstance(config.gradient_clipping, float)


def test_precedence_cli_over_env_over_file_over_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("zero: {stage: 1, overlap_comm: false}\nprecision: {dtype: bf16}\n")
    environ = {"ZERORUN_ZERO__STAGE": "2", "ZERORUN_PRECISION__DTYPE": "fp16", "ZERORUN_SEED": "7",
               "ZERORUN_DEBUG": "1", "ZERORUN_TELEMETRY_FD": "5", "ZERORUN_CONFIG": "/x.json"}
    config = load_config(path, environ=environ, overrides={"zero.stage": 3})
    assert config.zero.stage == 3                # CLI beats env and file
    assert config.precision.dtype == "fp16"      # env beats file
    assert config.zero.overlap_comm is False     # file beats default
    assert config.zero.reduce_bucket_size == ZeroConfig().reduce_bucket_size  # default
    assert config.seed == 7
    # Only the "__" form and the two top-level names are config; the launcher's variables are not.
    assert config_env_names(environ) == ["ZERORUN_PRECISION__DTYPE", "ZERORUN_SEED", "ZERORUN_ZERO__STAGE"]


def test_environment_is_read_from_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("ZERORUN_ZERO__OFFLOAD_OPTIMIZER__DEVICE", "cpu")
    monkeypatch.setenv("ZERORUN_ZERO__STAGE", "2")
    config = load_config(None)
    assert (config.zero.stage, config.zero.offload_optimizer.device) == (2, "cpu")
    assert load_config(None, environ={}).zero.stage == 0
    # A config object is already resolved: the environment is not applied to it a second time.
    resolved = ZerorunConfig(zero=ZeroConfig(stage=1))
    assert load_config(resolved).zero.stage == 1
    assert load_config(resolved, overrides={"zero.stage": 3}).zero.stage == 3


def test_env_values_are_parsed_as_yaml_scalars():
    environ = {"ZERORUN_TELEMETRY__ENABLED": "false", "ZERORUN_CHECKPOINT__DIR": "/ckpt",
               "ZERORUN_ACTIVATION_CHECKPOINTING__MODULES": "[GPT2Block, Block]",
               "ZERORUN_TELEMETRY__TOTAL_STEPS": "null", "ZERORUN_GRADIENT_CLIPPING": "0.5",
               "ZERORUN_OPTIMIZER__TYPE": "SGD", "ZERORUN_OPTIMIZER__PARAMS__LR": "3e-4",
               "ZERORUN_OPTIMIZER__PARAMS__NESTEROV": "false"}
    config = load_config(None, environ=environ)
    # "3e-4" is text to PyYAML; torch needs the number, since params are passed through as given.
    assert config.optimizer.params == {"lr": 0.0003, "nesterov": False}
    assert load_config(None, environ={"ZERORUN_CHECKPOINT__DIR": "2024"}).checkpoint.dir == "2024"
    assert config.telemetry.enabled is False
    assert config.checkpoint.dir == "/ckpt"
    assert config.activation_checkpointing.modules == ["GPT2Block", "Block"]
    assert config.telemetry.total_steps is None
    assert config.gradient_clipping == 0.5


def test_overrides_can_create_optional_sections_and_reach_into_params():
    config = load_config(None, environ={}, overrides={
        "optimizer.type": "SGD", "optimizer.params.lr": 0.1, "zero": {"stage": 1}})
    assert config.optimizer == OptimizerConfig(type="SGD", params={"lr": 0.1})
    assert config.zero.stage == 1


def test_overrides_apply_to_deepspeed_files_in_zerorun_terms():
    ds = {"train_batch_size": 16, "zero_optimization": {"stage": 2}}
    config = load_config(ds, environ={"ZERORUN_ZERO__STAGE": "1"}, overrides={"precision.dtype": "bf16"},
                         world_size=2)
    assert config.zero.stage == 1 and config.precision.dtype == "bf16"
    assert config.batch == BatchConfig(16, 8, 1)


@pytest.mark.parametrize("given, world, expected", [
    ((None, None, None), 4, (None, None, None)),   # the script batches its own data
    ((None, None, 4), 2, (None, None, 4)),
    ((64, None, None), 4, (64, 16, 1)),
    ((None, 8, None), 4, (32, 8, 1)),
    ((64, 8, None), 4, (64, 8, 2)),
    ((64, None, 2), 4, (64, 8, 2)),
    ((None, 8, 2), 3, (48, 8, 2)),
    ((48, 8, 2), 3, (48, 8, 2)),
    ((48, 8, 2), None, (48, 8, 2)),
    ((64, None, None), None, (64, None, None)),
])
def test_batch_rule_derives_the_missing_size(given, world, expected):
    problems = Problems()
    resolved = resolve_batch(BatchConfig(*given), world, problems)
    assert not problems
    assert (resolved.train_batch_size, resolved.micro_batch_size, resolved.gradient_accumulation_steps) == expected
    if all(v is not None for v in expected) and world is not None:
        assert expected[0] == expected[1] * expected[2] * world


def test_resolved_batch_is_checked_again_by_the_engine():
    # The launcher resolves with its world size and writes to_dict(); a worker loading that
    # dict with a different world size (a misconfigured restart) must be told.
    resolved = to_dict(load_config({"batch": {"train_batch_size": 64}}, world_size=4, environ={}))
    assert load_config(resolved, world_size=4, environ={}).batch == BatchConfig(64, 16, 1)
    with pytest.raises(ConfigError, match="must equal micro_batch_size"):
        load_config(resolved, world_size=2, environ={})


def test_accumulation_property_defaults_to_one():
    assert load_config(None, environ={}).gradient_accumulation_steps == 1
    assert load_config({"batch": {"gradient_accumulation_steps": 4}}, environ={}).gradient_accumulation_steps == 4


def test_every_numeric_key_has_a_range_rule():
    numeric = {path for path, hint in field_paths(ZerorunConfig).items()
               if any(t in (int, float) for t in getattr(hint, "__args__", (hint,)))}
    assert numeric == set(RANGES)


def test_to_dict_is_plain_json_and_excludes_notes():
    config = load_config({"train_batch_size": 8, "steps_per_print": 10}, world_size=2, environ={})
    assert config.notes  # the DeepSpeed note is on the object...
    data = to_dict(config)
    assert "notes" not in data  # ...but not in the schema dict
    assert json.loads(json.dumps(data)) == data
    assert data["batch"] == {"train_batch_size": 8, "micro_batch_size": 4, "gradient_accumulation_steps": 1}


# --- round trip, fuzzed over valid configs -----------------------------------------------

_positive = st.integers(min_value=1, max_value=2**40)
_finite = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False)
_names = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\x00"),
                 max_size=12)  # a NUL is refused in every string key
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**50, 2**50) | _finite | _names,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_names, inner, max_size=3),
    max_leaves=8,
)


@st.composite
def valid_configs(draw) -> ZerorunConfig:
    stage = draw(st.integers(0, 3))
    offload_choices = ["none", "cpu", "nvme"] if stage else ["none"]

    def offload(allowed):
        device = draw(st.sampled_from(allowed))
        path = draw(st.one_of(st.none(), _names.filter(bool))) if device != "nvme" else "/nvme"
        return OffloadConfig(device=device, nvme_path=path, pin_memory=draw(st.booleans()))

    micro, accum = draw(_positive), draw(st.integers(1, 64))
    world = draw(st.integers(1, 16))
    config = ZerorunConfig(
        zero=ZeroConfig(stage=stage, reduce_bucket_size=draw(_positive), allgather_bucket_size=draw(_positive),
                        overlap_comm=draw(st.booleans()), prefetch_bucket_size=draw(_positive),
                        param_persistence_threshold=draw(st.integers(0, 2**40)),
                        offload_optimizer=offload(offload_choices),
                        offload_param=offload(offload_choices if stage == 3 else ["none"])),
        precision=PrecisionConfig(dtype=draw(st.sampled_from(["fp32", "bf16", "fp16"])),
                                  loss_scale=draw(st.sampled_from([0.0, 1024.0])),
                                  initial_scale_power=draw(st.integers(0, 63)),
                                  min_loss_scale=draw(_finite)),
        batch=draw(st.sampled_from([BatchConfig(), BatchConfig(micro * accum * world, micro, accum)])),
        gradient_clipping=draw(st.one_of(st.just(0.0), _finite)),
        optimizer=draw(st.one_of(st.none(), st.just(OptimizerConfig(type="SGD", params={"lr": 0.5})))),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**32 - 1))),
    )
    config.activation_checkpointing.modules = draw(st.lists(_names, max_size=3))
    return config


@settings(max_examples=150, deadline=None)
@given(valid_configs())
def test_round_trip_through_to_dict(config):
    data = to_dict(config)
    assert load_config(data, environ={}) == config
    assert to_dict(load_config(json.loads(json.dumps(data)), environ={})) == data
    assert load_config(yaml.safe_load(yaml.safe_dump(data)), environ={}) == config


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(_names, _json, max_size=4))
def test_free_form_params_survive_building_unchanged(params):
    problems = Problems()
    assert convert(params, dict[str, Any], "optimizer.params", problems) == params
    assert not problems


def test_docs_list_every_key():
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    missing = [path for path in field_paths(ZerorunConfig) if f"| `{path}` |" not in docs]
    assert missing == []


def test_set_flags_become_overrides():
    overrides = parse_settings(["zero.stage=3", "checkpoint.dir=2024", "optimizer.params.lr=3e-4",
                                "zero.offload_param.device=cpu"])
    assert overrides == {"zero.stage": 3, "checkpoint.dir": "2024", "optimizer.params.lr": 0.0003,
                         "zero.offload_param.device": "cpu"}
    config = load_config({"optimizer": {"type": "AdamW"}}, overrides=overrides, environ={})
    assert (config.zero.stage, config.checkpoint.dir, config.optimizer.params) == (3, "2024", {"lr": 0.0003})
    with pytest.raises(ConfigError, match="write KEY=VALUE"):
        parse_settings(["zero.stage"])
