"""pytest tests/distributed/test_checkpoint_crash.py — a crash during a save never costs the
previous checkpoint (zerorun/zero/checkpoint/save.py Note [commit order]).

Two gloo ranks save ``global_step2`` at stage 3, train two more steps and start saving
``global_step4``; rank 1 SIGKILLs itself in the middle of writing its shard (the spawner then
stops rank 0, blocked at the save's barrier). ``latest`` must still name global_step2, the
half-written save must be only a ``.partial`` directory, and a fresh engine (world 1, another
stage) must load global_step2 with exactly the values saved. A commit interrupted between moving
an old copy of a tag aside and renaming the new one into place still loads (the aside copy).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import zerorun
from zerorun.errors import CheckpointError
from zerorun.zero.checkpoint import save

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkpoint_harness as h


@pytest.mark.slow
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    with pytest.raises(mp.ProcessExitedException) as killed:
        h.spawn(h.crash_world, 2, str(tmp_path))
    assert killed.value.exit_code == -9 or killed.value.signal_name == "SIGKILL"
    assert (tmp_path / "killed").exists()
    root = tmp_path / "ckpt"
    assert (root / "latest").read_text() == "global_step2"
    assert (root / "global_step4.partial").is_dir() and not (root / "global_step4").exists()
    assert not (root / "global_step4.partial" / "manifest.json").exists()
    saved = torch.load(tmp_path / "at_step2.pt", weights_only=True)
    model = h.build_dropnet()
    engine = zerorun.initialize(model, h.optimizer_for(model), {"zero": {"stage": 1}})
    path, _ = engine.load_checkpoint(root)
    assert path == str(root / "global_step2") and engine.global_step == 2
    loaded = engine.full_state_dict()
    for key, value in saved.items():
        assert torch.equal(value, loaded[key]), key
    with pytest.raises(CheckpointError, match="no checkpoint"):
        engine.load_checkpoint(root, tag="global_step4")
    engine.save_checkpoint(root, tag="global_step4")  # the stale .partial does not get in the way
    assert (root / "latest").read_text() == "global_step4" and not (root / "global_step4.partial").exists()


def test_an_interrupted_replacement_still_loads(tmp_path, monkeypatch):
    model = h.build_dropnet()
    engine = zerorun.initialize(model, h.optimizer_for(model), {"zero": {"stage": 2}})
    h.run_steps(engine, h.ResumeCase("x", 2), 0, range(1))
    engine.save_checkpoint(tmp_path, tag="best")
    before = engine.full_state_dict()
    h.run_steps(engine, h.ResumeCase("x", 2), 0, range(1, 2))
    renames = []
    real_rename = os.rename

    def rename_then_crash(src, dst):
        renames.append(dst)
        if len(renames) == 2:  # the new copy's rename into place
            raise KeyboardInterrupt("crash")
        real_rename(src, dst)

    monkeypatch.setattr(save.os, "rename", rename_then_crash)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(tmp_path, tag="best")
    monkeypatch.undo()
    assert not (tmp_path / "best").exists()
    fresh = h.build_dropnet()
    other = zerorun.initialize(fresh, h.optimizer_for(fresh), {"zero": {"stage": 3}})
    path, _ = other.load_checkpoint(tmp_path, tag="best")
    assert ".replaced-" in path and other.global_step == 1
    after = other.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
