"""pytest tests/unit/test_deepspeed_initialize.py — ``deepspeed.initialize`` and the engine's DeepSpeed names.

A world of one (``init_distributed`` starts a one-rank gloo group, as DeepSpeed does without a
launcher). One test per row of docs/deepspeed.md's table that involves the engine: what
DeepSpeed's ``initialize`` returns and does (config sources, model_parameters, optimizer and
scheduler callables, the training DataLoader), each accessor's value, the engine standing in for
the model, and no false ConfigPrecedenceWarning on a run without ``--config``.
"""

from __future__ import annotations

import argparse
import json
import warnings

import pytest
import torch
from torch import nn

import zerorun.deepspeed as deepspeed
from zerorun.config import load_config, to_dict
from zerorun.config.precedence import ConfigPrecedenceWarning
from zerorun.errors import ConfigError

from deepspeed_alone import alone  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("alone")


class Tagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(5, 4)
        self.head = nn.Linear(4, 2)
        self.label = "tagged"  # what DeepSpeed scripts reach through the engine (engine.label)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))

    def describe(self) -> str:
        return f"{self.label} model"


def config(**extra) -> dict:
    base = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}}}
    base.update(extra)
    return base


def train(engine, steps: int, batch: int = 4) -> list[float]:
    losses = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(batch, 5, generator=generator), torch.randint(0, 2, (batch,), generator=generator)
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_initialize_returns_deepspeeds_four_tuple_and_starts_the_group():
    model = Tagged()
    data = torch.utils.data.TensorDataset(torch.randn(10, 5), torch.randint(0, 2, (10,)))
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=argparse.Namespace(local_rank=-1, deepspeed_config=None), model=model,
        model_parameters=model.parameters(), training_data=data, config=config())
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
    assert optimizer is engine.optimizer and type(optimizer) is torch.optim.AdamW
    assert scheduler is engine.lr_scheduler and type(scheduler).__name__ == "WarmupLR"
    # DeepSpeed's loader: micro-batches of this rank's DistributedSampler share, seed 0, no set_epoch.
    assert isinstance(loader.sampler, torch.utils.data.DistributedSampler) and loader.batch_size == 4
    reference = list(torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0))
    assert [len(b[0]) for b in loader] == [4, 4, 2] and list(loader.sampler) == reference


def test_config_from_args_deepspeed_config_and_not_twice(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config(zero_optimization={"stage": 2})))
    model = Tagged()
    engine, *_ = deepspeed.initialize(args=argparse.Namespace(deepspeed_config=str(path)), model=model)
    assert engine.zero_optimization_stage() == 2
    with pytest.raises(ConfigError, match="both as args.deepspeed_config and to initialize"):
        deepspeed.initialize(args=argparse.Namespace(deepspeed_config=str(path)), model=Tagged(), config=config())
    with pytest.raises(ConfigError, match="needs model="):
        deepspeed.initialize(config=config())


def test_config_optimizer_is_built_over_model_parameters_groups():
    model = Tagged()
    groups = [{"params": list(model.body.parameters()), "weight_decay": 0.1},
              {"params": list(model.head.parameters()), "weight_decay": 0.0}]
    _, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config_params=config())
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in optimizer.param_groups] == [0.0, 0.0]  # WarmupLR's first value
    assert len(optimizer.param_groups) == 2  # (each now steps its groups' flat masters)


def test_optimizer_and_scheduler_callables_and_a_passed_scheduler_wins():
    model = Tagged()
    made = {}

    def make_scheduler(optimizer):
        made["optimizer"] = optimizer
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=lambda params: torch.optim.SGD(params, lr=0.4), lr_scheduler=make_scheduler,
        config={"train_batch_size": 4})
    assert type(optimizer) is torch.optim.SGD and made["optimizer"] is optimizer
    train(engine, 2)
    assert engine.get_lr() == [0.1] and scheduler.last_epoch == 2  # engine.step() stepped it
    # A scheduler object passed in beats the config's, as in DeepSpeed 0.19.
    model = Tagged()
    sgd = torch.optim.SGD(model.parameters(), lr=0.2)
    mine = torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 1.0)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=sgd, lr_scheduler=mine,
                                                   config={"train_batch_size": 4, "scheduler": config()["scheduler"]})
    assert scheduler is mine and engine.lr_scheduler is mine


def test_engine_accessors_answer_as_deepspeeds():
    model = Tagged()
    engine, *_ = deepspeed.initialize(model=model, config=config(
        train_batch_size=8, train_micro_batch_size_per_gpu=4, gradient_clipping=0.5, bf16={"enabled": True}))
    assert engine.device == torch.device("cpu") and engine.local_rank == 0
    assert (engine.global_rank, engine.world_size) == (0, 1)
    assert engine.bfloat16_enabled() and not engine.fp16_enabled()
    assert engine.gradient_accumulation_steps() == 2  # a method, as in DeepSpeed
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu()) == (8, 4)
    assert engine.zero_optimization_stage() == 0
    boundaries = []
    for _ in range(4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        train(engine, 1)
    assert boundaries == [False, True, False, True] and engine.global_steps == 2
    assert engine.was_step_applied() and engine.get_lr() == [0.01 * 0.5]  # WarmupLR log warmup at step 2
    norm = engine.get_global_grad_norm()
    assert isinstance(norm, float) and norm > 0


def test_engine_stands_in_for_the_model():
    model = Tagged()
    engine, *_ = deepspeed.initialize(model=model, config=config())
    assert engine.module is model
    assert [n for n, _ in engine.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(engine.parameters(), model.parameters(), strict=True))
    assert engine.state_dict().keys() == model.state_dict().keys()
    assert engine.label == "tagged" and engine.describe() == "tagged model"  # attributes fall through
    with pytest.raises(AttributeError, match="neither the engine nor its model"):
        _ = engine.no_such_thing
    engine.eval()
    assert not model.training
    engine.train()
    assert model.training


def test_stage3_state_dict_and_16bit_exports_are_the_whole_model(tmp_path):
    model = Tagged()
    engine, *_ = deepspeed.initialize(model=model, config=config(
        zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0}, bf16={"enabled": True}))
    train(engine, 2)
    whole = engine.full_state_dict()
    state = engine.state_dict()  # at stage 3 the gathered one, not 0-byte views
    assert all(torch.equal(state[k], whole[k]) for k in whole)
    assert [p.ds_numel for p in model.parameters()] == [20, 4, 8, 2]  # DeepSpeed's per-parameter count
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    assert consolidated.keys() == whole.keys() and consolidated["head.weight"].dtype == torch.bfloat16
    assert engine.save_16bit_model(tmp_path, "model.bin") is True
    saved = torch.load(tmp_path / "model.bin", weights_only=True)
    assert all(torch.equal(saved[k], whole[k]) for k in whole)


def test_launchers_device_choice_moves_a_model_built_elsewhere(monkeypatch):
    from zerorun.worker import device
    from zerorun.zero.engine import _compute_device

    monkeypatch.setenv("ZERORUN_DEVICE", "cuda:1")  # what zerorun --gpus sets for local rank 1
    monkeypatch.setattr(device, "visible_gpus", lambda: 2)  # a node with two GPUs
    assert _compute_device(torch.device("cpu")) == torch.device("cuda", 1)
    monkeypatch.setattr(device, "visible_gpus", lambda: 0)
    monkeypatch.delenv("ZERORUN_DEVICE")
    assert _compute_device(torch.device("cpu")) == torch.device("cpu")  # no launcher, no GPU: the CPU


def test_no_precedence_warning_when_the_launcher_got_no_config(tmp_path, monkeypatch):
    launcher = tmp_path / "config.json"  # what `zerorun --nproc 1 script.py` writes: defaults only
    launcher.write_text(json.dumps(to_dict(load_config(None, world_size=1, environ={}))))
    monkeypatch.setenv("ZERORUN_CONFIG", str(launcher))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        deepspeed.initialize(model=Tagged(), config=config())
    assert not [w for w in caught if issubclass(w.category, ConfigPrecedenceWarning)]
    # A launcher config that sets something the script's replaces still says so.
    launcher.write_text(json.dumps(to_dict(load_config({"zero": {"stage": 2}}, world_size=1, environ={}))))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        deepspeed.initialize(model=Tagged(), config=config())
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigPrecedenceWarning)]
    assert len(messages) == 1 and "zero.stage: script 0, --config 2" in messages[0]


def test_init_distributed_alone_starts_a_group_of_one_and_writes_the_environment():
    import os

    deepspeed.init_distributed()
    assert torch.distributed.is_initialized() and deepspeed.comm.get_world_size() == 1
    assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")} == {
        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    deepspeed.init_distributed()  # a second call finds the group and leaves it
    assert deepspeed.comm.get_backend() == "gloo"


def test_comm_collectives_are_torch_distributeds():
    deepspeed.init_distributed()
    comm = deepspeed.comm
    assert (comm.get_rank(), comm.get_world_size(), comm.get_local_rank(), comm.is_initialized()) == (0, 1, 0, True)
    tensor = torch.tensor([2.0, 3.0])
    comm.all_reduce(tensor, op=comm.ReduceOp.SUM)
    comm.broadcast(tensor, src=0)
    gathered = [torch.zeros(2)]
    comm.all_gather(gathered, tensor)
    comm.barrier()
    assert torch.equal(gathered[0], torch.tensor([2.0, 3.0]))


def test_zero_init_builds_on_meta_and_enabled_false_builds_normally():
    with deepspeed.zero.Init(config_dict_or_path=config()):
        lazy = Tagged()
    with deepspeed.zero.Init(enabled=False):
        eager = Tagged()
    assert all(p.is_meta for p in lazy.parameters()) and not any(p.is_meta for p in eager.parameters())
    engine, *_ = deepspeed.initialize(model=lazy, config=config(zero_optimization={"stage": 3}))
    assert not any(p.is_meta for p in engine.full_state_dict().values())  # materialized by initialize
    train(engine, 1)
