"""pytest tests/unit/test_checkpoint_trust.py — crafted checkpoints refused before anything loads.

Issue 38 item 3 (Note [checked against its own files] in zerorun/zero/checkpoint/validate.py): a
manifest edited and its checksum recomputed (names outside the tag directory, huge and negative
shapes, bad dtypes, pieces or byte ranges a file does not hold) is refused in one line by
``load_checkpoint``, with the model and the optimizer bit-identical to before, and by
``consolidate``, with nothing written. World size 1, a four-record stage-1 engine.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from torch import nn

import zerorun
from zerorun.errors import CheckpointError
from zerorun.zero.checkpoint.consolidate import consolidate
from zerorun.zero.checkpoint.format import MANIFEST, manifest_checksum
from zerorun.zero.checkpoint.tensor_files import CHECKSUM

TAG = "global_step2"


def _engine():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # A small bucket: four records, so a load that fails late would have changed the first ones.
    return zerorun.initialize(model, opt, {"zero": {"stage": 1, "reduce_bucket_size": 16}})


def _train(engine, steps):
    for _ in range(steps):
        engine.backward(engine(torch.randn(4, 7)).pow(2).mean())
        engine.step()


def _state(engine):
    params = {k: v.clone() for k, v in engine.module.state_dict().items()}
    masters = [r.master.clone() for r in engine.records]
    opt = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for s in engine.optimizer.state.values()]
    return params, masters, opt, engine.global_step


def _same(a, b):
    (pa, ma, oa, sa), (pb, mb, ob, sb) = a, b
    assert sa == sb and pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    assert len(ma) == len(mb) and all(torch.equal(x, y) for x, y in zip(ma, mb, strict=True))
    assert len(oa) == len(ob)
    for x, y in zip(oa, ob, strict=True):
        assert x.keys() == y.keys()
        assert all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x)


def _rewrite(tag_dir, change):
    path = tag_dir / MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    manifest["checksum"] = manifest_checksum(manifest)  # what anyone editing it can do
    path.write_text(json.dumps(manifest))


def _rename_key(manifest, old, *new):
    keys = manifest["ranks"][0]["keys"]
    at = keys.index(old)
    keys[at:at + 1] = list(new)


def _rewrite_header(tag_dir, change):
    """Edit rank0.safetensors' own header and record the file's new size and crc32."""
    import zlib
    path = tag_dir / "rank0.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    data = struct.pack("<Q", len(text)) + text + data[8 + length:]
    path.write_bytes(data)
    _rewrite(tag_dir, lambda m: m["files"]["rank0.safetensors"].update(
        {"bytes": len(data), CHECKSUM: f"{zlib.crc32(data):08x}"}))


def _last_piece(header):
    return max((k for k in header if k.startswith("master/")), key=lambda k: header[k]["data_offsets"][1])


CRAFTED = {
    # name: (change to the manifest, or ("header", change to the file's header), expected text)
    "name outside the tag dir": (lambda m: m["files"].__setitem__("../../outside.safetensors", m["files"].pop("engine.pt")),
                                 "lists file '../../outside.safetensors', a name outside its tag directory"),
    "absolute name": (lambda m: m["files"].__setitem__("/etc/passwd", {"bytes": 1, "crc32": "0"}),
                      "a name outside its tag directory"),
    "huge shape": (lambda m: m["parameters"]["0.weight"].__setitem__("shape", [2 ** 33]), "0.weight"),
    "negative shape": (lambda m: m["parameters"]["0.weight"].__setitem__("shape", [-5, 7]), "has a negative size"),
    "bad dtype": (lambda m: m["parameters"]["2.bias"].__setitem__("dtype", "F128"), "has dtype 'F128', not one zerorun writes"),
    "bad training dtype": (lambda m: m.__setitem__("dtype", "complex"), "training dtype 'complex'"),
    # The probe's case: more elements claimed than the file holds (a raw KeyError after some records loaded).
    "piece the file lacks": (lambda m: _rename_key(m, "master/0.weight/0+35", "master/0.weight/0+30", "master/0.weight/30+5"),
                             "which the file does not hold"),
    "piece past its parameter": (lambda m: _rename_key(m, "master/0.weight/0+35", "master/0.weight/0+36"),
                                 "claims elements 0-36 of '0.weight', which has 35"),
    "byte range past the file's end": (("header", lambda h: h[_last_piece(h)]["data_offsets"].__setitem__(1, 10 ** 9)),
                                       "outside the file's"),
    "header dtype": (("header", lambda h: h[_last_piece(h)].__setitem__("dtype", "X9")), "has dtype 'X9'"),
    "header shape": (("header", lambda h: h[_last_piece(h)].__setitem__("shape", [2 ** 40])), "not the size of its shape"),
}


def _craft(tmp_path, case):
    source = _engine()
    _train(source, 2)
    source.save_checkpoint(tmp_path / "ckpt")
    change, expected = CRAFTED[case]
    if isinstance(change, tuple):
        _rewrite_header(tmp_path / "ckpt" / TAG, change[1])
    else:
        _rewrite(tmp_path / "ckpt" / TAG, change)
    return expected


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_checkpoint_is_refused_by_load_with_nothing_changed(tmp_path, case):
    expected = _craft(tmp_path, case)
    target = _engine()
    _train(target, 1)
    before = _state(target)
    with pytest.raises(CheckpointError) as caught:
        target.load_checkpoint(tmp_path / "ckpt")
    assert expected in str(caught.value) and "\n" not in str(caught.value)
    _same(before, _state(target))


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_checkpoint_is_refused_by_consolidate_with_nothing_written(tmp_path, case):
    expected = _craft(tmp_path, case)
    (tmp_path / "outside.safetensors").write_bytes(b"x" * 12345)  # a foreign file the name points at
    out = tmp_path / "out" / "model.safetensors"
    with pytest.raises(CheckpointError) as caught:
        consolidate(tmp_path / "ckpt", out)
    assert expected in str(caught.value) and "\n" not in str(caught.value)
    assert "12345" not in str(caught.value)  # the foreign file is never read
    assert not out.exists() and not (tmp_path / "out").exists()


def test_the_cli_refuses_a_crafted_checkpoint_in_one_line(tmp_path):
    import os
    import subprocess
    import sys

    expected = _craft(tmp_path, "huge shape")
    done = subprocess.run([sys.executable, "-m", "zerorun", "consolidate", str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("zerorun: error:")]
    assert len(errors) == 1 and expected in errors[0], done.stderr
    assert not (tmp_path / "m.safetensors").exists()


def test_an_untouched_checkpoint_still_loads_and_consolidates_within_its_stated_bound(tmp_path):
    source = _engine()
    _train(source, 2)
    source.save_checkpoint(tmp_path / "ckpt")
    target = _engine()
    target.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(source.module.state_dict().values(), target.module.state_dict().values(), strict=True))
    done = consolidate(tmp_path / "ckpt", tmp_path / "model.safetensors")
    assert done["peak_bytes"] == 35 * 8  # the largest tensor (0.weight) in fp32, plus its fp32 copy
