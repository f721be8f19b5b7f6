"""pytest tests/unit/test_input_bounds.py — hostile input is refused cheaply, with one ConfigError/HostfileError line."""

from __future__ import annotations

import os
import time

import pytest

from zerorun.config import load_config
from zerorun.config.sources import MAX_YAML_DEPTH, parse_scalar, parse_text, read_small_file
from zerorun.errors import ConfigError, HostfileError
from zerorun.launch.hostfile import parse_hostfile, select_hosts, slurm_hosts
from zerorun.worker.slurm_env import expand_nodelist, expand_tasks_per_node

BOMB = "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 10) if prev else ', '.join(['lol'] * 10)}]\n"
    for prev, name in zip([None, "a", "b", "c", "d", "e", "f", "g"], "abcdefgh", strict=True)
)


def _quick(call, error, fragment):
    started = time.monotonic()
    with pytest.raises(error) as info:
        call()
    assert time.monotonic() - started < 2.0
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_yaml_alias_bomb_and_deep_nesting_are_refused_before_construction(tmp_path):
    assert len(BOMB) < 500
    _quick(lambda: parse_text(BOMB, "bomb.yaml", json_syntax=False), ConfigError, "more than 100,000 values")
    deep = "a: " + "[" * (MAX_YAML_DEPTH + 1) + "]" * (MAX_YAML_DEPTH + 1)
    _quick(lambda: parse_text(deep, "deep.yaml", json_syntax=False), ConfigError, "nested more than")
    (tmp_path / "bomb.yaml").write_text(BOMB)
    _quick(lambda: load_config(str(tmp_path / "bomb.yaml")), ConfigError, "aliases")
    _quick(lambda: parse_scalar("{" + BOMB.replace("\n", ", ") + "}"), ConfigError, "too many values")
    # Ordinary aliases still work.
    assert parse_text("a: &x {lr: 1}\nb: *x\n", "ok.yaml", json_syntax=False) == {"a": {"lr": 1}, "b": {"lr": 1}}


def test_only_small_regular_files_are_read(tmp_path):
    os.symlink("/dev/zero", tmp_path / "zero.yaml")
    _quick(lambda: read_small_file(tmp_path / "zero.yaml", "config file"), ConfigError, "is not a regular file")
    os.mkfifo(tmp_path / "fifo.yaml")
    _quick(lambda: read_small_file(tmp_path / "fifo.yaml", "config file"), ConfigError, "is not a regular file")
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * ((1 << 20) + 1))
    _quick(lambda: read_small_file(big, "hostfile", HostfileError), HostfileError, "larger than 1024 KiB")
    _quick(lambda: read_small_file(tmp_path / "none", "env file"), ConfigError, "does not exist")
    _quick(lambda: read_small_file(tmp_path, "config file"), ConfigError, "is a directory")
    (tmp_path / "ok.yaml").write_text("zero: {stage: 1}\n")
    assert read_small_file(tmp_path / "ok.yaml", "config file") == "zero: {stage: 1}\n"


def test_host_counts_are_bounded_before_anything_is_expanded():
    _quick(lambda: expand_nodelist("n[0-99999999999]"), HostfileError, "names more than 100,000 nodes")
    _quick(lambda: expand_nodelist("a[0-60000],b[0-60000]"), HostfileError, "more than 100,000")
    _quick(lambda: expand_tasks_per_node("2(x99999999999)", 3), HostfileError, "more counts than the 3 nodes")
    _quick(lambda: parse_hostfile("a slots=99999999999\n"), HostfileError, "more than 1024 workers on one host")
    _quick(lambda: slurm_hosts({"SLURM_JOB_NODELIST": "n1", "SLURM_GPUS_ON_NODE": "99999999"}), HostfileError,
           "more than 1024 tasks")
    _quick(lambda: select_hosts({f"h{i}": 1024 for i in range(1000)}), HostfileError, "slots in all")
    assert expand_nodelist("n[8-10]") == ["n8", "n9", "n10"]
