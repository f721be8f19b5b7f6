"""pytest tests/distributed/test_sharded_construction.py — models built on the meta device.

Covers zerorun/zero/construct.py: a meta model loaded from weights equals the eager model it
was saved from (tied weights, a sharded Hugging Face directory, every stage), random
initialization is identical on every rank, clear errors for what cannot work, and the memory
claim: at stage 3 on 2 ranks a 201M-parameter model built on meta and loaded from a safetensors
file grows each rank's peak RSS during set-up by at most 0.6x what building it eagerly does,
then trains with the same losses.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zero_parity_harness as harness
from gloo_world import run_ranks

import zerorun
from zerorun.errors import RuntimeConfigError


def _save_odd_net(path: Path) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in harness.build_model().state_dict().items()}
    # Saved as Hugging Face saves a tied model: the head's copy of the embedding is left out.
    save_file({k: v for k, v in state.items() if k != "head.weight"}, str(path))
    return state


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_meta_model_loaded_from_safetensors_trains_like_the_eager_model(stage, tmp_path):
    state = _save_odd_net(tmp_path / "odd.safetensors")
    case = harness.Case(f"s{stage}", stage)
    eager = harness.train_engine(case, 0, 1)
    with torch.device("meta"):
        model = harness.OddNet()
    engine = zerorun.initialize(model, harness.build_optimizer(model, "adamw"), case.config(),
                                weights=tmp_path / "odd.safetensors")
    loaded = engine.full_state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert model.head.weight is model.embed.weight  # the tie survived materialization
    tokens, targets = harness.global_batch(0)
    losses = []
    for step in range(harness.STEPS):
        tokens, targets = harness.global_batch(step)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    assert losses == eager["losses"]


def test_sharded_hugging_face_directory_loads_by_index(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=16)
    torch.manual_seed(0)
    eager = GPT2LMHeadModel(config).eval()
    eager.save_pretrained(tmp_path, max_shard_size="20KB")  # several files and an index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero": {"stage": 3}},
                                weights=tmp_path, param_init_fn=model._init_weights)
    engine.eval()
    ids = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        assert torch.allclose(engine(ids).logits, eager(ids).logits, atol=1e-6)


def test_meta_model_without_weights_is_initialized_by_reset_parameters():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(40, 30), nn.LayerNorm(30), nn.Linear(30, 5))
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero": {"stage": 3}})
    state = engine.full_state_dict()
    assert torch.equal(state["1.weight"], torch.ones(30)) and torch.equal(state["1.bias"], torch.zeros(30))
    bound = 1 / 40 ** 0.5  # nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert state["0.weight"].abs().max() <= bound and state["0.weight"].std() > bound / 3


def test_what_cannot_be_materialized_is_a_clear_error(tmp_path):
    class NoInit(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4, 4))

        def forward(self, x):
            return x @ self.weight

    with torch.device("meta"):
        model = NoInit()
    with pytest.raises(RuntimeConfigError, match="has no reset_parameters"):
        zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    save_file({"0.weight": torch.zeros(3, 3), "0.bias": torch.zeros(4)}, str(tmp_path / "w.safetensors"))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(RuntimeConfigError, match=r"'0.weight' in '.*w.safetensors' have shape \(3, 3\)"):
        zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {}, weights=tmp_path / "w.safetensors")


# -- two ranks ------------------------------------------------------------------------------
BIG_LAYERS, BIG_WIDTH = 48, 2048  # 48 x (2048 x 2048 + 2048) = 201.4M parameters, 806 MB in fp32
# Units of about one layer (4.2M elements): set-up holds the shards plus about one unit.
BIG_CONFIG = {"zero": {"stage": 3, "allgather_bucket_size": 4_000_000}}


def _big_model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(BIG_WIDTH, BIG_WIDTH) for _ in range(BIG_LAYERS)])


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM (the peak), so what came before the set-up
    (imports, the spawn's unpickling) cannot stand in for its peak."""
    Path("/proc/self/clear_refs").write_text("5")


def _peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _construct(rank: int, settings: dict) -> dict:
    torch.set_num_threads(1)
    _reset_peak_rss()
    baseline = _rss_bytes()
    if settings["mode"] == "meta":
        with torch.device("meta"):
            model = _big_model()
        engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=1e-3), BIG_CONFIG,
                                    weights=settings["weights"])
    else:
        torch.manual_seed(0)
        model = _big_model()
        engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=1e-3), BIG_CONFIG)
    growth = _peak_rss_bytes() - baseline
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(2):
        x = torch.randn(4, BIG_WIDTH, generator=gen)[rank * 2 : rank * 2 + 2]
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return {"growth": growth, "losses": losses}


@pytest.mark.slow
@pytest.mark.long  # 201M parameters built twice
def test_meta_construction_bounds_setup_memory_at_stage3(tmp_path):
    torch.manual_seed(0)
    weights = tmp_path / "big.safetensors"
    save_file(_big_model().state_dict(), str(weights))
    results = {}
    for mode in ("eager", "meta"):
        out = tmp_path / mode
        out.mkdir()
        results[mode] = run_ranks(_construct, 2, out, {"mode": mode, "weights": str(weights)})
    for rank in range(2):
        eager, meta = results["eager"][rank], results["meta"][rank]
        ratio = meta["growth"] / eager["growth"]
        print(f"rank {rank}: set-up growth eager {eager['growth'] / 2**20:.0f} MiB, "
              f"meta {meta['growth'] / 2**20:.0f} MiB, ratio {ratio:.2f}")
        assert ratio <= 0.6
        assert meta["losses"] == eager["losses"]


def test_meta_model_goes_where_the_launcher_says(monkeypatch):
    monkeypatch.setenv("ZERORUN_DEVICE", "cpu")
    with torch.device("meta"):
        model = nn.Linear(4, 3)
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    assert model.weight.device.type == "cpu" and engine.pg.device.type == "cpu"


def _partial_weights(rank: int) -> dict:
    torch.manual_seed(100 + rank)  # eager models that disagree across ranks
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4))
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero": {"stage": 2}},
                                weights=zerorun.Weights({"0.weight": torch.ones(5, 6)}, strict=False))  # the rest is not in the weights
    state = {k: v.tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}
    return state


def test_eager_model_with_partial_weights_agrees_across_ranks(tmp_path):
    ranks = run_ranks(_partial_weights, 2, tmp_path)
    assert ranks[0] == ranks[1]
    assert ranks[0]["0.weight"] == [[1.0] * 6] * 5
