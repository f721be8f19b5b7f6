"""pytest tests/unit/test_host_pools.py — stage 3's pools on a CPU host give memory back as soon
as the rest of the pass has no use for it (Note [pools follow backward], Note [own mappings]).

World size 1 (no process group): the gatherer and reducer run their full logic, the
collectives are local copies."""

from __future__ import annotations

import psutil
import torch
from torch import nn

import zerorun
from zerorun.zero.grad_reduce import BucketPool
from zerorun.zero.host_memory import host_buffer
from zerorun.zero.gather_plan import gathers_still_wanted
from zerorun.zero.unit.storage import GatherPool

MIB = 1 << 20


def test_gathers_still_wanted_counts_each_size_from_each_position_on():
    assert gathers_still_wanted([[10, 20], [10], []]) == [{10: 2, 20: 1}, {10: 1}, {}, {}]
    assert gathers_still_wanted([]) == [{}]


def test_gather_pool_keeps_no_more_than_the_rest_of_the_pass_will_take():
    pool = GatherPool()
    small = [pool.take(100) for _ in range(3)]
    large = pool.take(200)
    for storage in [*small, large]:
        pool.give_back(storage)
    assert pool.nbytes() == 500  # expect(None), as in forward's first call: everything is kept
    pool.expect({100: 1})
    assert pool.nbytes() == 100
    pool.give_back(pool.take(100))  # still one wanted: kept
    pool.give_back(host_buffer(100).untyped_storage())  # a second one is not
    assert pool.nbytes() == 100
    pool.expect({})
    assert pool.nbytes() == 0


def test_bucket_pool_keeps_no_more_idle_buckets_than_units_left_to_take_one():
    pool = BucketPool(16, torch.float32, torch.device("cpu"), keep=3, users=3)
    (a, _), (b, _) = pool.take(16), pool.take(8)
    pool.give_back(a)  # one unit still to come: kept
    pool.give_back(b)  # dropped
    assert pool.nbytes() == 16 * 4 and pool.takes_left == 1
    c, _ = pool.take(16)
    assert c is a and pool.takes_left == 0
    pool.give_back(c)
    assert pool.nbytes() == 0
    pool.clear()  # end of backward: the next backward takes afresh
    assert pool.takes_left == 3


def test_a_dropped_host_buffer_returns_its_memory_to_the_os():
    process = psutil.Process()
    before = process.memory_info().rss
    buffer = host_buffer(64 * MIB)
    buffer.fill_(1)
    touched = process.memory_info().rss
    del buffer
    after = process.memory_info().rss
    assert touched - before >= 60 * MIB, (before, touched)
    assert touched - after >= 60 * MIB, (touched, after)


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class _TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 16, layers: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x).logsumexp(-1).mean()


def test_stage3_pools_are_empty_when_the_head_runs_and_when_the_embeddings_backward_runs():
    """Where stage 3 peaks on a CPU host: the loss (logits beside the gathered head) and the
    embedding's backward (its dense gradient). By then no block will be gathered again in that
    pass, so no idle block buffer may sit in the gather pool, nor an idle bucket in the
    reducer's (in flight ones are still lent)."""
    torch.manual_seed(0)
    model = _TinyLM()
    config = {"zero": {"stage": 3, "param_persistence_threshold": 0}}
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    assert engine.gatherer is not None and engine.gatherer.pool is not None
    seen: dict[str, list[int]] = {"head": [], "embedding backward": [], "blocks' backward": []}

    def idle_buckets() -> int:
        return sum(len(pool._free) for pool in engine.reducer._pools.values())

    model.head.register_forward_pre_hook(lambda *_: seen["head"].append(engine.gatherer.pool.nbytes()))
    model.blocks[2].register_full_backward_pre_hook(
        lambda *_: seen["blocks' backward"].append(engine.gatherer.pool.nbytes()))

    def before_embedding_backward(grad):
        seen["embedding backward"].append(engine.gatherer.pool.nbytes() + idle_buckets())
        return grad

    def hook_embedding_output(_module, _args, output) -> None:
        output.register_hook(before_embedding_backward)

    model.emb.register_forward_hook(hook_embedding_output)
    for _ in range(3):
        engine.backward(engine(torch.randint(0, 64, (2, 8))))
        engine.step()
    # The first forward records the order; from the second on the pools follow it. Mid-backward
    # the pool still lends blocks their buffers (the check can fail: it sees something there).
    assert seen["head"][1:] == [0, 0] and seen["embedding backward"][1:] == [0, 0], seen
    assert seen["head"][0] > 0 and all(n > 0 for n in seen["blocks' backward"]), seen
