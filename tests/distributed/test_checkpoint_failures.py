"""pytest tests/distributed/test_checkpoint_failures.py — a save that fails on one rank, seen by every rank.

Two gloo ranks save once (after a first save that rank 0's full disk failed: the other rank's
hint then claims no previous checkpoint), then rank 0's disk fills up (fsync raises ENOSPC) during the next
save. Before, rank 0 died of a raw ENOSPC traceback and rank 1 of a misleading gloo
"connection closed". Now rank 0 raises one line naming its file and the bytes written, rank 1
one line naming rank 0, both ranks stay in step (they leave together), the previous checkpoint
stays the latest, and the next good save removes what the failed one left. Then a file only
rank 1 reads is damaged: the load is refused on both ranks and neither engine changes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gloo_world import run_ranks

pytestmark = pytest.mark.slow


def _fill_then_damage(rank: int, out_dir: str) -> dict:
    import errno
    import os

    import torch
    import torch.distributed as dist

    import zerorun
    from zerorun.errors import CheckpointError
    from zerorun.zero.checkpoint import tensor_files

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), {"zero": {"stage": 2}})

    def train():
        engine.backward(engine(torch.randn(4, 7)).pow(2).mean())
        engine.step()

    real = os.fsync

    def failed_save() -> CheckpointError | None:
        """A save during which rank 0's disk is full."""
        if rank == 0:
            def full(fd):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            tensor_files.os.fsync = full
        try:
            engine.save_checkpoint(f"{out_dir}/ckpt")
            return None
        except CheckpointError as exc:
            return exc
        finally:
            tensor_files.os.fsync = real

    train()
    first_failed = failed_save()  # the directory holds no checkpoint yet
    engine.save_checkpoint(f"{out_dir}/ckpt")
    train()
    failed = failed_save()
    error = None if failed is None else str(failed)
    train()
    engine.save_checkpoint(f"{out_dir}/ckpt")
    # A file only rank 1 reads is damaged: every rank refuses, none has changed.
    dist.barrier()
    if rank == 0:
        path = Path(out_dir, "ckpt", "global_step3", "rank1.safetensors")
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    dist.barrier()
    train()
    before = [p.detach().clone() for p in engine.module.parameters()]
    try:
        engine.load_checkpoint(f"{out_dir}/ckpt")
        load_error = None
    except CheckpointError as exc:
        load_error = str(exc)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True)) and engine.global_step == 4
    hints = [None if e is None else e.hint for e in (first_failed, failed)]
    return {"error": error, "load_error": load_error, "unchanged": unchanged, "hints": hints}


def test_a_full_disk_on_one_rank_is_one_line_on_every_rank(tmp_path):
    ranks = run_ranks(_fill_then_damage, 2, tmp_path, str(tmp_path))
    first, second = ranks[0]["error"], ranks[1]["error"]
    assert first.startswith("rank 0: writing ") and first.endswith("bytes (No space left on device)"), first
    assert second == "rank 1: writing checkpoint global_step2 failed on rank 0 (its error says why)", second
    # Issue 38 (late refusals): "the previous checkpoint is intact" only where there is one.
    assert ranks[1]["hints"] == ["no checkpoint of this directory existed before this save, and none was written",
                                 "the previous checkpoint (global_step1) is intact"], ranks[1]["hints"]
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step3"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".zerorun-owner", "global_step1", "global_step3", "latest"]
    assert "rank1.safetensors' fails its crc32 checksum" in ranks[1]["load_error"], ranks[1]["load_error"]
    assert ranks[0]["load_error"].startswith("rank 0: checking checkpoint ") and ranks[0]["load_error"].endswith(
        "failed on rank 1 (its error says why)")
    assert ranks[0]["unchanged"] and ranks[1]["unchanged"]
