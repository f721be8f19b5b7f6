"""pytest tests/fuzz/test_config_fuzz.py — fuzzing config loading: no input, however wrong, produces anything but a ConfigError."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerorun.config import ZerorunConfig, load_config
from zerorun.config.build import field_paths
from zerorun.config.deepspeed import OFFLOAD_OPTIMIZER, TOP_LEVEL, ZERO_OPTIMIZATION
from zerorun.config.sources import parse_text
from zerorun.errors import ConfigError

# Keys a fuzzer would never guess: the real ones, so inputs get deep into the rules.
ZERORUN_KEYS = sorted({part for path in field_paths(ZerorunConfig) for part in path.split(".")})
DEEPSPEED_KEYS = sorted(set(TOP_LEVEL) | set(ZERO_OPTIMIZATION) | set(OFFLOAD_OPTIMIZER) |
                        {"enabled", "type", "params", "loss_scale", "lr"})
KEYS = st.sampled_from(ZERORUN_KEYS + DEEPSPEED_KEYS) | st.text(max_size=8)
SCALARS = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10)
           | st.sampled_from(["auto", "cpu", "nvme", "none", "bf16", "fp16", "AdamW", "5e8", "-1", "nan"]))
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=5),
    max_leaves=25,
)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def loads_or_config_error(source, **kwargs) -> None:
    kwargs.setdefault("environ", {})
    try:
        config = load_config(source, **kwargs)
    except ConfigError as err:
        message = str(err)
        assert message and message.splitlines()[0].strip(), "an error needs a one-line summary"
        return
    assert isinstance(config, ZerorunConfig)


@FUZZ
@given(st.dictionaries(KEYS, VALUES, max_size=6), st.one_of(st.none(), st.integers(1, 9)))
def test_random_structures(data, world_size):
    loads_or_config_error(data, world_size=world_size)


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(field_paths(ZerorunConfig))) | st.text(max_size=12),
                       VALUES, max_size=4),
       st.dictionaries(st.text(max_size=20).map(lambda s: "ZERORUN_" + s), st.text(max_size=12), max_size=4))
def test_random_overrides_and_environment(overrides, environ):
    loads_or_config_error(None, overrides=overrides, environ=environ)


@FUZZ
@given(st.text(max_size=200))
def test_random_yaml_and_json_text(text):
    for json_syntax in (False, True):
        try:
            data = parse_text(text, "fuzz", json_syntax=json_syntax)
        except ConfigError:
            continue
        loads_or_config_error(data)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(KEYS, VALUES, max_size=6))
def test_random_files(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "config.json"
    path.write_text(json.dumps(data, default=str))
    loads_or_config_error(path)


def test_deep_nesting_is_a_config_error(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("[" * 100_000)
    with pytest.raises(ConfigError):
        load_config(path, environ={})
    deep: dict = {}
    node = deep
    for _ in range(5000):
        node["params"] = {}
        node = node["params"]
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config({"optimizer": {"type": "SGD", "params": deep}}, environ={})
