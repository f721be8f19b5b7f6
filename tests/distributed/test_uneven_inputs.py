"""pytest tests/distributed/test_uneven_inputs.py — ``engine.join()`` runs an eval loop whose ranks
have different numbers of batches (Note [uneven inputs] in zerorun/zero/uneven.py).

2 gloo ranks at stage 3, every module its own unit: a training step, an eval loop with 2
batches on rank 0 and 3 on rank 1 inside ``with engine.join():`` (rank 0 shadows rank 1's last
forward), then two more training steps. Every eval loss and every training loss equals plain
torch on the same batches (1e-5 relative; fp32, only the order of the gradient sum differs). A
forward with autograd on inside the context is refused in one line on every rank, and the
ranks train on after it.
"""

from __future__ import annotations

import pytest
import torch

from agreement_harness import Reference, build_model, engine_for, eval_batch, record, run_world, train_batch, train_on

EVAL_BATCHES = {0: 2, 1: 3}


def uneven_eval(rank: int, seen: dict) -> None:
    import zerorun
    from zerorun.errors import UsageError

    engine = engine_for(build_model())
    train_on(engine, train_batch(0, rank), seen)
    engine.eval()
    with torch.no_grad(), engine.join():
        for index in range(EVAL_BATCHES[rank]):
            record(seen, "eval", engine(*eval_batch(index, rank)).item())
    engine.train()
    try:
        with zerorun.uneven_inputs(engine):
            engine(*train_batch(1, rank))
    except UsageError as err:
        seen["refused"] = str(err)
    for step in (1, 2):
        train_on(engine, train_batch(step, rank), seen)


@pytest.mark.timeout(900)
def test_an_eval_loop_with_uneven_batches_matches_plain_torch(tmp_path):
    results = run_world(tmp_path, "uneven_eval", __name__)
    reference = Reference()
    train = [reference.train_step(0)]
    evals = {rank: [reference.eval_loss(i, rank) for i in range(n)] for rank, n in EVAL_BATCHES.items()}
    train += [reference.train_step(1), reference.train_step(2)]
    for rank, seen in results.items():
        assert "error" not in seen, seen["error"]["traceback"]
        assert seen["eval"] == pytest.approx(evals[rank], rel=1e-5)
        assert seen["train"] == pytest.approx([losses[rank] for losses in train], rel=1e-5)
        assert "eval forwards only" in seen["refused"]
