"""pytest tests/unit/test_checkpoint_safety.py — checkpoints that cannot be clobbered or misread.

One process (world size 1) saves and loads a tiny engine. What they prove: a client_state that
could not load again is refused at save naming the key; a refused load leaves the engine as it
was; a second live job on one directory is refused naming it, a dead one's lock is taken over;
a symlink planted at a temporary name is never followed; tags from disk or from the caller are
one path component, and only bounded regular files are read; the manifest is checksummed; a
changed optimizer type or group layout is one error line; a full disk is one line, and what a
failed save left is cleaned by the next good one.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import zerorun
from zerorun.errors import CheckpointError
from zerorun.zero.checkpoint import save, tensor_files
from zerorun.zero.checkpoint.format import MANIFEST


def _engine(optimizer="adamw", groups=1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
    if groups == 2:
        params = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]
    else:
        params = model.parameters()
    opt = torch.optim.AdamW(params, lr=1e-2) if optimizer == "adamw" else torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return zerorun.initialize(model, opt, {"zero": {"stage": 1}})


def _train(engine, steps=2):
    for _ in range(steps):
        engine.backward(engine(torch.randn(4, 7)).pow(2).mean())
        engine.step()


def _state(engine):
    params = {k: v.clone() for k, v in engine.module.state_dict().items()}
    opt = {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
           for i, s in enumerate(engine.optimizer.state.values())}
    return params, opt, engine.global_step, [dict((k, v) for k, v in g.items() if k != "params") for g in engine.optimizer.param_groups]


def _same(a, b):
    (pa, oa, sa, ga), (pb, ob, sb, gb) = a, b
    assert sa == sb and ga == gb
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    assert oa.keys() == ob.keys()
    for i in oa:
        for k in oa[i]:
            assert torch.equal(oa[i][k], ob[i][k]) if torch.is_tensor(oa[i][k]) else oa[i][k] == ob[i][k]


# -- item 4: client_state ---------------------------------------------------------------------
@pytest.mark.parametrize("value, kind", [(argparse.Namespace(lr=0.1), "argparse.Namespace"),
                                         ("numpy", "numpy.float64"), (frozenset([1]), "frozenset")])
def test_a_client_state_that_could_not_load_is_refused_at_save_naming_the_key(tmp_path, value, kind):
    if value == "numpy":
        import numpy
        value = numpy.float64(0.5)
    engine = _engine()
    _train(engine)
    with pytest.raises(CheckpointError) as caught:
        engine.save_checkpoint(tmp_path, client_state={"epoch": 3, "args": value})
    assert str(caught.value).startswith(f"client_state['args'] is a {kind}, which a checkpoint could not load again")
    assert "\n" not in str(caught.value)
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_plain_client_state_round_trips(tmp_path):
    engine = _engine()
    _train(engine)
    state = {"args": vars(argparse.Namespace(lr=0.1)), "seen": [1, 2.5, "x", None], "t": torch.ones(2), "s": {1}}
    engine.save_checkpoint(tmp_path, client_state=state)
    _, loaded = _engine().load_checkpoint(tmp_path)
    assert loaded["args"] == {"lr": 0.1} and loaded["seen"] == [1, 2.5, "x", None] and loaded["s"] == {1}


def test_a_refused_load_leaves_the_engine_untouched(tmp_path, monkeypatch):
    source = _engine()
    _train(source, 3)
    monkeypatch.setattr(save, "check_client_state", lambda state: None)  # as an old zerorun saved it
    source.save_checkpoint(tmp_path, client_state={"args": argparse.Namespace(lr=0.1)})
    target = _engine()
    _train(target, 1)
    before = _state(target)
    with pytest.raises(CheckpointError, match=r"engine.pt' cannot be loaded \(it holds argparse.Namespace, which "
                                              r"the safe unpickler does not load\)") as caught:
        target.load_checkpoint(tmp_path)
    # Issue 31 item 18: torch's own text advises weights_only=False, never to be said of a file from disk.
    assert "weights_only" not in str(caught.value) + str(caught.value.hint)
    _same(before, _state(target))


class _Calls:
    """Pickles as a call of os.getcwd (harmless had it run): the shape of a payload that runs code."""

    def __reduce__(self):
        return (os.getcwd, ())


def test_a_refused_call_is_named_in_the_one_line(tmp_path, monkeypatch):
    """Issue 38 (messages): a file whose pickle calls a function of a blocked module (torch:
    "unsupported GLOBAL posix.getcwd whose module posix is blocked") was "an object it does not
    load", though docs/checkpoints.md says the refused type is named. Both readers name it."""
    source = _engine()
    _train(source, 1)
    monkeypatch.setattr(save, "check_client_state", lambda state: None)
    source.save_checkpoint(tmp_path / "ck", client_state={"payload": _Calls()})
    target = _engine()
    with pytest.raises(CheckpointError, match=r"engine.pt' cannot be loaded \(it names posix.getcwd \(module posix\), "
                                              r"which the safe unpickler does not load\)"):
        target.load_checkpoint(tmp_path / "ck")
    torch.save({"0.weight": _Calls()}, tmp_path / "w.pt")
    model = nn.Sequential(nn.Linear(7, 5))
    with pytest.raises(zerorun.errors.RuntimeConfigError, match=r"\(it names posix.getcwd \(module posix\), which"):
        zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {}, weights=tmp_path / "w.pt")


@pytest.mark.parametrize(("torch_says", "we_say"), [
    ("Trying to call reduce for unrecognized function <built-in function system> which belongs to <module 'posix' "
     "(built-in)>", "it calls posix.system, which the safe unpickler does not call"),
    ("Trying to call reduce for unrecognized function <function helper at 0x7f00>",
     "it calls helper, which the safe unpickler does not call"),
    ("Can only create new object for nn.Parameter or classes allowlisted via `add_safe_globals` but got "
     "<class 'argparse.Namespace'>", "it builds argparse.Namespace, which the safe unpickler does not load"),
    ("Can only build Tensor, Parameter, OrderedDict or types allowlisted via `add_safe_globals`, but got "
     "<class 'mod.Thing'>", "it builds mod.Thing, which the safe unpickler does not load"),
])
def test_every_refusal_torch_names_a_global_in_is_named_in_ours(torch_says, we_say):
    error = RuntimeError("Weights only load failed. Re-running `torch.load` with `weights_only` set to `False` will "
                         f"likely succeed. {torch_says}")
    assert tensor_files.load_refusal(error) == we_say


@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_a_planted_partial_is_removed_never_followed(tmp_path, planted):
    """Issue 31 item 15: a symlink at ``TAG.partial`` failed the save with "File exists"
    and no file named; ``.partial`` is zerorun's own name, so it is removed, not followed."""
    engine = _engine()
    _train(engine)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    tmp_path.joinpath("ck").mkdir()
    staging = tmp_path / "ck" / "global_step2.partial"
    if planted == "symlink":
        staging.symlink_to(victim)
    else:
        staging.write_text("planted")
    engine.save_checkpoint(tmp_path / "ck")
    assert (tmp_path / "ck" / "global_step2" / MANIFEST).is_file() and not os.path.lexists(staging)
    assert (victim / "keep").read_text() == "x" and [p.name for p in victim.iterdir()] == ["keep"]


# -- item 6: one owner --------------------------------------------------------------------------
HOLDER = r'''
import sys, time
from pathlib import Path
from zerorun.zero.checkpoint import owner
owner.claim(Path(sys.argv[1]), "slurm777")
print("held", flush=True)
time.sleep(300)
'''


def test_a_second_live_job_is_refused_and_a_dead_ones_lock_is_taken_over(tmp_path):
    engine = _engine()
    _train(engine)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError) as caught:
            engine.save_checkpoint(tmp_path)
        message = str(caught.value)
        assert f"checkpoint directory {str(tmp_path)!r} is in use by job slurm777 (pid {holder.pid} on " in message
        assert not (tmp_path / "latest").exists()
    finally:
        holder.kill()
        holder.wait()
    engine.save_checkpoint(tmp_path)  # the holder died: its lock went with it
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert json.loads((tmp_path / ".zerorun-owner").read_text())["pid"] == os.getpid()


# -- item 8: temporaries -----------------------------------------------------------------------
def test_a_symlink_planted_at_a_temporary_name_is_not_followed(tmp_path, monkeypatch):
    engine = _engine()
    _train(engine)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "latest.tmp").symlink_to(victim)  # the old fixed name
    engine.save_checkpoint(root)
    assert victim.read_text() == "precious"
    assert (root / "latest").read_text() == "global_step2" and not (root / "latest").is_symlink()
    # Even at the unique name, O_EXCL|O_NOFOLLOW refuses to open through a planted link.
    monkeypatch.setattr(tensor_files.secrets, "token_hex", lambda n: "feed")
    (root / f"latest.tmp-{os.getpid()}-feed").symlink_to(victim)
    with pytest.raises(CheckpointError, match="File exists"):
        tensor_files.write_bytes_atomically(root / "latest", b"x")
    assert victim.read_text() == "precious"


# -- item 9: names and files from disk -----------------------------------------------------
@pytest.mark.parametrize("bad", ["../elsewhere", "/etc", "global_step*", "best\n", "a/b", ".."])
def test_tags_from_latest_or_the_caller_are_one_path_component(tmp_path, bad):
    engine = _engine()
    _train(engine)
    engine.save_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="is not a checkpoint tag"):
        engine.load_checkpoint(tmp_path, tag=bad)
    (tmp_path / "latest").write_bytes(bad.encode() + b"x" if bad == "best\n" else bad.encode())
    with pytest.raises(CheckpointError, match="is not a checkpoint tag"):
        engine.load_checkpoint(tmp_path)


def test_a_save_tag_with_a_trailing_newline_is_refused(tmp_path):
    engine = _engine()
    with pytest.raises(CheckpointError, match="cannot be used"):
        engine.save_checkpoint(tmp_path, tag="best\n")


@pytest.mark.parametrize("special", ["dev-zero", "fifo", "huge-latest"])
def test_only_bounded_regular_files_are_read(tmp_path, special):
    engine = _engine()
    _train(engine)
    engine.save_checkpoint(tmp_path)
    tag = tmp_path / "global_step2"
    if special == "dev-zero":
        (tag / MANIFEST).unlink()
        (tag / MANIFEST).symlink_to("/dev/zero")
        expected = "is not a regular file"
    elif special == "fifo":
        (tag / MANIFEST).unlink()
        os.mkfifo(tag / MANIFEST)
        expected = "is not a regular file"
    else:
        (tmp_path / "latest").write_bytes(b"x" * 10_000)
        expected = "is 10000 bytes, more than the 4096"
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=expected):
        engine.load_checkpoint(tmp_path)
    assert time.monotonic() - started < 10


# -- item 10: manifest checksum, optimizer type and groups -------------------------------------
@pytest.mark.parametrize("relabel", [None, 1])
def test_an_edited_manifest_fails_its_checksum(tmp_path, relabel):
    """relabel=1: ``format_version: 1`` used to skip the checksum."""
    engine = _engine()
    _train(engine)
    engine.save_checkpoint(tmp_path)
    path = tmp_path / "global_step2" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["ranks"][0]["scalars"] = {name: {"step": {"tensor": 1000.0, "dtype": "F32"}} for name in manifest["ranks"][0]["scalars"]}
    if relabel is not None:
        manifest["format_version"] = relabel
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest.json' fails its crc32 checksum"):
        _engine().load_checkpoint(tmp_path)


@pytest.mark.parametrize("saved, loaded, expected", [
    ("adamw", "sgd", "holds AdamW optimizer state; this engine's optimizer is SGD"),
    ("sgd", "adamw", "holds SGD optimizer state; this engine's optimizer is AdamW"),
])
def test_a_changed_optimizer_type_is_one_error_line(tmp_path, saved, loaded, expected):
    source = _engine(saved)
    _train(source)
    source.save_checkpoint(tmp_path)
    target = _engine(loaded)
    before = _state(target)
    with pytest.raises(CheckpointError, match=expected):
        target.load_checkpoint(tmp_path)
    _same(before, _state(target))
    target.load_checkpoint(tmp_path, load_optimizer_states=False)  # the weights alone still load


def test_a_changed_group_layout_is_one_error_line(tmp_path):
    source = _engine(groups=2)
    _train(source)
    source.save_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="has 2 optimizer param group"):
        _engine(groups=1).load_checkpoint(tmp_path)


# -- item 11: a full disk, leftovers ---------------------------------------------------------
def test_a_full_disk_is_one_line_and_the_next_good_save_cleans_up(tmp_path, monkeypatch):
    engine = _engine()
    _train(engine)
    engine.save_checkpoint(tmp_path)
    _train(engine)
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tensor_files.os, "fsync", full)
    with pytest.raises(CheckpointError) as caught:
        engine.save_checkpoint(tmp_path)
    message = str(caught.value)
    assert message.startswith("rank 0: writing ") and "rank0.safetensors' failed after " in message
    assert message.endswith("bytes (No space left on device)")
    assert (tmp_path / "latest").read_text() == "global_step2"  # the previous checkpoint stands
    assert (tmp_path / "global_step4.partial").is_dir()
    monkeypatch.setattr(tensor_files.os, "fsync", real_fsync)
    engine.save_checkpoint(tmp_path, tag="best")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".zerorun-owner", "best", "global_step2", "latest"], left


def test_a_file_system_without_locks_is_one_line_not_a_false_holder(tmp_path, monkeypatch):
    from zerorun.zero.checkpoint import owner

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(owner.fcntl, "lockf", no_locks)
    engine = _engine()
    _train(engine)
    with pytest.raises(CheckpointError, match=r"cannot lock '.*\.zerorun-owner' \(No locks available\)"):
        engine.save_checkpoint(tmp_path / "nolocks")


def test_resume_with_no_checkpoint_directory_yet_starts_fresh_then_resumes(tmp_path, capsys):
    """checkpoint.resume on a job's first start (the directory is not there yet) is step 0, as
    docs/checkpoints.md promises; the same config then resumes what was saved."""
    ckpt = tmp_path / "ckpts"
    config = {"zero": {"stage": 1}, "checkpoint": {"dir": str(ckpt), "resume": True}}

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
        return zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)

    first = build()
    assert first.global_step == 0 and not ckpt.exists()
    assert f"checkpoint.resume: {ckpt} does not exist yet; starting from step 0" in capsys.readouterr().err
    _train(first, steps=3)
    first.save_checkpoint(str(ckpt))
    second = build()
    assert second.global_step == 3
    _same(_state(first), _state(second))


def _resuming(directory, keep_last=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
    return zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), {
        "zero": {"stage": 1}, "checkpoint": {"dir": str(directory), "resume": True, "interval_steps": 2,
                                             "keep_last": keep_last}})


@pytest.mark.parametrize("damage", ["empty", "blank", "directory"])
def test_an_unusable_latest_resumes_from_the_newest_complete_tag_never_from_step_0(tmp_path, capsys, damage):
    """A 0-byte ``latest`` read as "no checkpoint yet"; the job trained from
    step 0 and moved ``latest`` back to its own low step."""
    first = _resuming(tmp_path, keep_last=2)
    _train(first, 12)
    assert sorted(p.name for p in tmp_path.glob("global_step*")) == ["global_step10", "global_step12"]
    latest = tmp_path / "latest"
    latest.unlink()
    if damage == "empty":
        latest.write_bytes(b"")
    elif damage == "blank":
        latest.write_bytes(b" \n\n")
    else:
        latest.mkdir()
    (tmp_path / "global_step14.partial").mkdir()  # an unfinished save is never a candidate
    capsys.readouterr()
    again = _resuming(tmp_path)
    err = capsys.readouterr().err
    assert again.global_step == 12, err
    note = [line for line in err.splitlines() if "newest complete tag" in line]
    assert len(note) == 1 and note[0].endswith("loading the newest complete tag 'global_step12' instead"), err
    assert "no latest" not in err and "step 0" not in err
    if damage != "directory":
        _train(again, 2)
        assert (tmp_path / "latest").read_text() == "global_step14"
        assert {"global_step10", "global_step12", "global_step14"} <= {p.name for p in tmp_path.iterdir()}


def test_an_unusable_latest_with_no_complete_tag_is_one_line(tmp_path):
    (tmp_path / "latest").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"latest' is empty, and no complete checkpoint is beside it"):
        _resuming(tmp_path)
