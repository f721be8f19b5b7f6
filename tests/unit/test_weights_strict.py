"""pytest tests/unit/test_weights_strict.py — weights= that must match the model.

One process. What they prove: by default (strict, as torch's load_state_dict) weights that
lack a parameter or hold a tensor the model has no name for are one error line with exact
counts and the first names, and a common name prefix is pointed out; strict=False warns with
the same exact counts (a meta model's 0 of 4 is "4 missing", not 2); integer data for a float
parameter is refused unless cast=True; every error names the file; a damaged file, a missing
safetensors package and an index naming files outside its directory are one line each.
"""

from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import zerorun
from zerorun.errors import RuntimeConfigError


def _model(meta=False):
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _weights():
    return {k: torch.full_like(v, 0.5) for k, v in _model().state_dict().items()}


def _init(model, weights):
    return zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {}, weights=weights)


@pytest.mark.parametrize("meta", [False, True])
def test_prefixed_names_are_an_error_by_default_with_the_prefix_named(tmp_path, meta):
    save_file({f"model.{k}": v for k, v in _weights().items()}, str(tmp_path / "w.safetensors"))
    with pytest.raises(RuntimeConfigError) as caught:
        _init(_model(meta), tmp_path / "w.safetensors")
    message = str(caught.value)
    assert message == (f"weights from {str(tmp_path / 'w.safetensors')!r}: 4 of the model's 4 parameters and buffers "
                       "are missing (first: '0.weight', '0.bias', '1.weight'); 4 tensors have no name in the model "
                       "(first: 'model.0.bias', 'model.0.weight', 'model.1.bias')")
    assert "prefix 'model.'" in caught.value.hint


def test_strict_false_warns_with_exact_counts_for_a_meta_model(tmp_path):
    save_file({f"model.{k}": v for k, v in _weights().items()}, str(tmp_path / "w.safetensors"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _init(_model(meta=True), zerorun.Weights(tmp_path / "w.safetensors", strict=False))
    texts = [str(w.message) for w in caught if "missing" in str(w.message)]
    assert len(texts) == 1 and "4 of the model's 4 parameters and buffers are missing" in texts[0]


def test_extra_tensors_are_an_error_by_default():
    weights = {**_weights(), "extra.weight": torch.ones(2)}
    with pytest.raises(RuntimeConfigError, match=r"^weights from the given state dict: 1 tensors have no name in the model \(first: 'extra.weight'\)"):
        _init(_model(), weights)
    with pytest.warns(UserWarning, match=r"1 tensors have no name in the model \(first: 'extra.weight'\) \(strict=False"):
        engine = _init(_model(), zerorun.Weights(weights, strict=False))
    assert torch.equal(engine.module[0].weight, torch.full((4, 3), 0.5))


def test_integer_data_for_a_float_parameter_is_refused_unless_cast(tmp_path):
    weights = _weights()
    weights["1.weight"] = torch.ones(2, 4, dtype=torch.int64)
    save_file(weights, str(tmp_path / "w.safetensors"))
    with pytest.raises(RuntimeConfigError, match=r"weights for '1.weight' in '.*w.safetensors' are int64, the model's parameter is float32"):
        _init(_model(), tmp_path / "w.safetensors")
    engine = _init(_model(), zerorun.Weights(tmp_path / "w.safetensors", cast=True))
    assert torch.equal(engine.module[1].weight, torch.ones(2, 4))


def test_a_damaged_file_is_one_line_naming_it(tmp_path):
    (tmp_path / "w.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(RuntimeConfigError) as caught:
        _init(_model(), tmp_path / "w.safetensors")
    assert str(caught.value).startswith(f"weights file {str(tmp_path / 'w.safetensors')!r} is not a readable safetensors file (")
    assert "\n" not in str(caught.value)


def test_missing_safetensors_is_a_clear_error(tmp_path, monkeypatch):
    save_file(_weights(), str(tmp_path / "w.safetensors"))
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(RuntimeConfigError, match="needs the safetensors package, which is not installed"):
        _init(_model(), tmp_path / "w.safetensors")


@pytest.mark.parametrize("file", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors", ".."])
def test_an_index_naming_files_outside_its_directory_is_refused(tmp_path, file):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file(_weights(), str(tmp_path / "outside.safetensors"))
    index = {"weight_map": {name: file for name in _weights()}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(RuntimeConfigError, match="which is not a file in the index's directory"):
        _init(_model(), model_dir)


def test_matching_weights_load_silently(tmp_path):
    save_file(_weights(), str(tmp_path / "w.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = _init(_model(meta=True), tmp_path / "w.safetensors")
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in engine.module.parameters())


# -- issue 31 items 5 and 20 --------------------------------------------------------------------
def _index_dir(tmp_path, shard_name="model-1.safetensors"):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {name: shard_name for name in _weights()}}))
    return model_dir


def test_an_index_naming_a_fifo_is_one_line_not_a_hang(tmp_path):
    """Issue 31 item 5: safetensors opened the FIFO and blocked initialize for ever."""
    import os
    import time

    model_dir = _index_dir(tmp_path)
    os.mkfifo(model_dir / "model-1.safetensors")
    started = time.monotonic()
    with pytest.raises(RuntimeConfigError, match="names 'model-1.safetensors', which is a FIFO, not a regular file"):
        _init(_model(), model_dir)
    assert time.monotonic() - started < 60


def test_a_symlinked_shard_outside_the_index_directory_is_said_once(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    model_dir = _index_dir(tmp_path)
    save_file(_weights(), str(tmp_path / "elsewhere.safetensors"))
    (model_dir / "model-1.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    engine = _init(_model(), model_dir)
    notes = [line for line in capsys.readouterr().err.splitlines() if "a symlink to" in line]
    assert len(notes) == 1 and "outside the index's directory; reading it" in notes[0], notes
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in engine.module.parameters())


def test_the_hugging_face_cache_layout_of_symlinks_is_silent(tmp_path, capsys):
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    save_file(_weights(), str(repo / "blobs" / "abc123"))
    snapshot = repo / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {name: "model-1.safetensors" for name in _weights()}}))
    (snapshot / "model-1.safetensors").symlink_to("../../blobs/abc123")
    _init(_model(), snapshot)
    assert "symlink" not in capsys.readouterr().err


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_infinite_weights_are_refused_naming_the_tensor(tmp_path, bad):
    weights = _weights()
    weights["0.weight"][1, 2] = bad
    save_file(weights, str(tmp_path / "w.safetensors"))
    with pytest.raises(RuntimeConfigError, match=r"weights for '0.weight' in .*w.safetensors' hold 1 NaN or "
                                                 r"infinite value\(s\) of 12"):
        _init(_model(), tmp_path / "w.safetensors")


def test_a_fifo_model_safetensors_is_said_to_be_no_regular_file_not_missing(tmp_path):
    """Issue 38 (messages): a directory whose model.safetensors is a FIFO was said to have no
    model.safetensors; a FIFO given as the weights path itself is named too."""
    import os

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    os.mkfifo(model_dir / "model.safetensors")
    with pytest.raises(RuntimeConfigError) as caught:
        _init(_model(), model_dir)
    assert caught.value.message == (f"weights directory {str(model_dir)!r}: model.safetensors is a FIFO, not a "
                                    "regular file"), caught.value.message
    with pytest.raises(RuntimeConfigError) as caught:
        _init(_model(), model_dir / "model.safetensors")
    assert caught.value.message == (f"weights {str(model_dir / 'model.safetensors')!r} is a FIFO, not a regular "
                                    "file or directory"), caught.value.message


def test_bf16_weights_into_an_fp32_model_are_said_once_as_a_note(tmp_path, capsys, monkeypatch):
    """Issue 38 (messages): bf16 weights were converted into an fp32 model without a word.
    One note for the whole load (four tensors), naming both dtypes; fp32 weights say nothing."""
    monkeypatch.delenv("RANK", raising=False)
    stored = {k: (v + 1 / 3).to(torch.bfloat16) for k, v in _weights().items()}
    save_file(stored, str(tmp_path / "bf16.safetensors"))
    engine = _init(_model(meta=True), tmp_path / "bf16.safetensors")
    notes = [line for line in capsys.readouterr().err.splitlines() if "converted on load" in line]
    assert len(notes) == 1, notes
    assert notes[0].startswith(f"zerorun: note: weights from {str(tmp_path / 'bf16.safetensors')!r} are stored as "
                               "bfloat16, the model's tensors are float32: converted on load (first: '"), notes
    assert notes[0].split("(first: '")[1].split("'")[0] in stored  # whichever the first unit holds
    loaded = dict(engine.module.named_parameters())
    assert all(loaded[k].dtype == torch.float32 and torch.equal(loaded[k], v.float()) for k, v in stored.items())
    save_file(_weights(), str(tmp_path / "fp32.safetensors"))
    _init(_model(meta=True), tmp_path / "fp32.safetensors")
    assert "converted on load" not in capsys.readouterr().err
