"""pytest tests/integrations/test_zero_init_pretrained.py — from_pretrained under ZeRO-3 on zerorun.

A tiny Llama and a tiny OPT are saved with ``save_pretrained`` from a config (nothing is
downloaded). On 2 gloo ranks, each set up as ``zerorun --as-deepspeed`` sets up a worker, with
transformers' own ``HfDeepSpeedConfig`` registered (tests/integrations/hf_zero3.py),
``from_pretrained`` takes its ZeRO-3 path: the model built under ``deepspeed.zero.Init``, loaded
module by module under ``GatheredParameters``; ``deepspeed.initialize`` trains it at stage 3. What must
hold: the buffers a constructor computes (Llama's rotary ``inv_freq``) are real after
construction, the loaded weights equal the saved ones exactly, and the per-step losses equal
plain torch's on the same global batch (fp32, 1e-4 relative).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_world

pytestmark = [pytest.mark.slow, pytest.mark.long]  # about 50 s: transformers in a 2-rank world

VOCAB = 97
STEPS = 3
GLOBAL_BATCH, SEQ = 4, 8
LR = 1e-3


def _config(family: str):
    from transformers import LlamaConfig, OPTConfig

    if family == "llama":
        return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    return OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                     max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))


def _train(model, rows: slice, update) -> list[float]:
    losses = []
    for step in range(STEPS):
        ids = _batch(step)[rows]
        loss = model(input_ids=ids, labels=ids).loss
        update(loss)
        losses.append(float(loss.detach()))
    return losses


def _plain_update(optimizer, loss) -> None:
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _engine_update(engine, loss) -> None:
    engine.backward(loss)
    engine.step()


FAMILIES = ("llama", "opt")


def _worker(rank: int, out_dir: str) -> None:
    from zerorun.zero.comm.process_group import leaving_together

    hf_world.join_world(rank, out_dir)
    with leaving_together():  # Note [clean exit] in zerorun/zero/comm/process_group.py
        _train_families(rank, out_dir)


def _train_families(rank: int, out_dir: str) -> None:
    from hf_zero3 import enable_transformers_zero3
    from transformers import AutoModelForCausalLM

    import torch.distributed as dist
    import zerorun.deepspeed as deepspeed

    ds_config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // 2,
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    keep = enable_transformers_zero3(ds_config)
    result = {}
    for family in FAMILIES:  # one world, the models in turn
        try:
            model = AutoModelForCausalLM.from_pretrained(Path(out_dir) / family)
            buffers = {name: not buffer.is_meta for name, buffer in model.named_buffers()}
            model.train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
            saved = torch.load(Path(out_dir) / f"{family}.pt", weights_only=True)
            loaded = engine.full_state_dict(rank0_only=False)
            unequal = sorted(name for name in saved if not torch.equal(loaded[name], saved[name]))
            sharded = all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
            rows = slice(rank * GLOBAL_BATCH // 2, (rank + 1) * GLOBAL_BATCH // 2)
            losses = torch.tensor(_train(engine, rows, functools.partial(_engine_update, engine)))
            dist.all_reduce(losses)  # the global batch's mean loss: equal rows and tokens per rank
            result[family] = {"buffers_real": buffers, "unequal": unequal, "sharded": sharded,
                              "losses": (losses / 2).tolist()}
        except Exception as error:  # the other family still runs; the test names this one's error
            result[family] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    hf_world.write_result(out_dir, rank, result)
    del keep


def test_from_pretrained_under_zero_init_trains_like_the_eager_model(tmp_path):
    from transformers import AutoModelForCausalLM

    expected = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_config(family)).save_pretrained(tmp_path / family)
        eager = AutoModelForCausalLM.from_pretrained(tmp_path / family)
        torch.save(eager.state_dict(), tmp_path / f"{family}.pt")
        eager.train()
        optimizer = torch.optim.AdamW(eager.parameters(), lr=LR, weight_decay=0.0)
        expected[family] = _train(eager, slice(None), functools.partial(_plain_update, optimizer))

    results = hf_world.spawn(_worker, tmp_path)
    for rank, result in results.items():
        for family in FAMILIES:
            got = result[family]
            assert "error" not in got, f"rank {rank}, {family}: {got['error']}"
            assert all(got["buffers_real"].values()), got["buffers_real"]
            assert got["unequal"] == [], f"rank {rank}, {family}: loaded weights differ from the saved ones"
            assert got["sharded"]
            assert got["losses"] == pytest.approx(expected[family], rel=1e-4), (rank, family, got["losses"])
        assert "model.rotary_emb.inv_freq" in result["llama"]["buffers_real"]  # computed in __init__, real
