"""pytest tests/distributed/test_collective_agreement.py — ranks that issue different collectives
are stopped before any of them uses a value (Note [collective agreement] in
zerorun/zero/comm/agreement.py).

Three ways a rank does different work at stage 3, each on 2 gloo ranks with every module its
own unit (``allgather_bucket_size: 1``): an eval loop with one batch more on one rank, a branch
("expert") that only one rank's rows reach, and ``generate`` of different lengths with
``synced_gpus=False``. Before the check, each paired one rank's all-gather of a unit with
another rank's different collective and trained on with wrong values, or hung. Now every rank
raises ``CollectiveMismatch`` at that collective, within seconds, naming each rank's collective
and the likely cause, and every loss computed before it equals plain torch's (1e-5 relative).
With ``generate``'s default (synced at stage 3) the same uneven lengths give plain torch's tokens.
The branch case runs twice: descriptors in the host channel's slot headers, and without a
channel (``ZERORUN_HOST_CHANNEL=0``: the ring driver, descriptors in band before the data).
"""

from __future__ import annotations

import time

import pytest
import torch

from agreement_harness import (
    WORLD, Reference, batch, build_model, engine_for, eval_batch, record, run_world, train_batch, train_on,
)

MISMATCH_WITHIN_S = 10.0


def _check_losses(seen: dict, reference: list[list[float]]) -> None:
    """Every train loss a rank computed before the mismatch equals plain torch's."""
    for step, loss in enumerate(seen.get("train", [])):
        assert loss == pytest.approx(reference[step][seen["rank"]], rel=1e-5), (step, seen["rank"])


def _stopped(tmp_path, body: str) -> tuple[dict[int, dict], str]:
    """Run ``body`` on both ranks; what they saw, and the mismatch that stopped both."""
    results = run_world(tmp_path, body, __name__)
    messages = []
    for rank, seen in results.items():
        error = seen.get("error")
        assert error is not None, f"rank {rank} trained on: {seen}"
        assert error["type"] == "CollectiveMismatch", error["traceback"]
        assert error["at"] - seen["diverged_at"] < MISMATCH_WITHIN_S
        messages.append(error["message"])
    assert messages[0] == messages[1]  # both ranks name the same pair of collectives
    assert all(f"rank {r}: " in messages[0] for r in range(WORLD))
    return results, messages[0]


# --- an extra eval forward on one rank -----------------------------------------------------------
def extra_eval_forward(rank: int, seen: dict) -> None:
    engine = engine_for(build_model())
    train_on(engine, train_batch(0, rank), seen)
    seen["diverged_at"] = time.monotonic()
    engine.eval()
    with torch.no_grad():
        for index in range(2 + rank):  # rank 1 runs one eval batch more
            record(seen, "eval", engine(*eval_batch(index, rank)).item())
    engine.train()
    train_on(engine, train_batch(1, rank), seen)


@pytest.mark.timeout(900)
def test_an_extra_eval_forward_on_one_rank_is_stopped(tmp_path):
    results, message = _stopped(tmp_path, "extra_eval_forward")
    assert "in eval" in message and "in forward" in message
    assert "engine.join()" in results[0]["error"]["hint"]
    reference = Reference()
    reference_losses = [reference.train_step(0)]
    for rank, seen in results.items():
        _check_losses(seen, reference_losses)
        assert len(seen["train"]) == 1  # no rank computed a loss after the divergence
        assert seen["eval"] == pytest.approx([reference.eval_loss(i, rank) for i in range(2)], rel=1e-5)


# --- a branch that only one rank's rows reach ---------------------------------------------------
def branch_on_one_rank(rank: int, seen: dict) -> None:
    engine = engine_for(build_model())
    seen["diverged_at"] = time.monotonic()
    train_on(engine, batch(77 + rank, (0, 1, 2) if rank == 0 else (0, 1)), seen)  # branch 2 only on rank 0


@pytest.mark.timeout(900)
@pytest.mark.parametrize("channel", ["host channel", "gloo side check"])
def test_a_branch_run_on_one_rank_only_is_stopped(tmp_path, monkeypatch, channel):
    if channel == "gloo side check":  # ranks that share no memory: the ring, and descriptors through gloo
        monkeypatch.setenv("ZERORUN_HOST_CHANNEL", "0")
    results, message = _stopped(tmp_path, "branch_on_one_rank")
    assert "(module 'branches.2')" in message and "(module 'head')" in message
    assert "set_z3_leaf_modules" in results[1]["error"]["hint"]
    for seen in results.values():
        assert "train" not in seen  # stopped in the first forward, before any loss


# --- generate of different lengths -------------------------------------------------------------
def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    config = GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=39, pad_token_id=39)
    return GPT2LMHeadModel(config).eval()


def _prompt(rank: int) -> torch.Tensor:
    return torch.randint(1, 39, (1, 5), generator=torch.Generator().manual_seed(50 + rank))


def _generate(rank: int, seen: dict, synced) -> None:
    import copy

    model = _tiny_gpt2()
    plain = copy.deepcopy(model)
    engine = engine_for(model)
    kwargs = {"max_new_tokens": 2 + 3 * rank, "do_sample": False}  # rank 1 generates 3 tokens more
    if synced is not None:
        kwargs["synced_gpus"] = synced
    seen["diverged_at"] = time.monotonic()
    with torch.no_grad():
        seen["tokens"] = engine.module.generate(_prompt(rank), **kwargs).tolist()
    seen["plain"] = plain.generate(_prompt(rank), max_new_tokens=2 + 3 * rank, do_sample=False).tolist()
    ids = _prompt(rank)
    loss = engine(input_ids=ids, labels=ids).loss  # the next training step
    record(seen, "train", loss.item())


def generate_default(rank: int, seen: dict) -> None:
    _generate(rank, seen, None)


def generate_unsynced(rank: int, seen: dict) -> None:
    _generate(rank, seen, False)


@pytest.mark.timeout(900)
def test_generate_of_different_lengths_is_synced_by_default(tmp_path):
    pytest.importorskip("transformers")
    results = run_world(tmp_path, "generate_default", __name__)
    for rank, seen in results.items():
        assert "error" not in seen, seen["error"]["traceback"]
        assert seen["tokens"] == seen["plain"]
        assert len(seen["tokens"][0]) == 5 + 2 + 3 * rank


@pytest.mark.timeout(900)
def test_generate_without_synced_gpus_is_stopped(tmp_path):
    pytest.importorskip("transformers")
    results, message = _stopped(tmp_path, "generate_unsynced")
    assert "in generate" in message
    assert "synced_gpus=True" in results[0]["error"]["hint"]
    for seen in results.values():
        assert "train" not in seen
