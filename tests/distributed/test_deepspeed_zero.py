"""pytest tests/distributed/test_deepspeed_zero.py — zerorun.deepspeed on 2 gloo ranks.

What a DeepSpeed script relies on across ranks: ``zero.GatheredParameters`` reading a stage-3
unit and, with ``modifier_rank=0``, writing rank 0's values through to every shard and master;
``zero.Init`` plus loading in the way Hugging Face's ``from_pretrained`` loads under ZeRO-3;
a DeepSpeed-style save/resume with ``client_state`` that resumes bit-exactly; the
``zero_to_fp32`` functions over the checkpoint; and one clear error when the ranks name
different checkpoint folders.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gloo_world import run_ranks

pytestmark = pytest.mark.slow


class Net(nn.Module):
    """Odd sizes, so units pad and split unevenly over 2 ranks."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 15)
        self.fc2 = nn.Linear(15, 17)
        self.fc3 = nn.Linear(17, 3)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def ds_config(stage: int, dtype: str = "fp32", **extra) -> dict:
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": dtype == "bf16"},
    }
    config.update(extra)
    return config


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 7, generator=generator), torch.randint(0, 3, (4,), generator=generator)


def _train_steps(engine, steps, start=0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step, engine.global_rank)
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


# -- GatheredParameters ------------------------------------------------------------------------
def _gathered(rank: int, out_dir: str) -> dict:
    import zerorun.deepspeed as deepspeed

    stage, dtype = Path(out_dir).name.split("-")[-2:]  # e.g. run-3-bf16
    torch.manual_seed(0)
    model = Net()
    config = ds_config(int(stage), dtype)
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.0}}  # a step must leave the values alone
    del config["scheduler"]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    weight = model.fc2.weight
    sharded_numel = weight.untyped_storage().nbytes()
    with deepspeed.zero.GatheredParameters([weight, model.fc2.bias]):
        read = weight.detach().float().clone()
    after_read = weight.untyped_storage().nbytes()
    read_matches = torch.equal(read, engine.full_state_dict(rank0_only=False)["fc2.weight"].float())
    with deepspeed.zero.GatheredParameters(list(model.fc2.parameters()), modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                weight.fill_(0.25)
                model.fc2.bias.copy_(torch.arange(17, dtype=weight.dtype))
    full = engine.full_state_dict(rank0_only=False)
    _train_steps(engine, 1)  # SGD with lr 0: publishes the masters into the model again
    stepped = engine.full_state_dict(rank0_only=False)
    return {
        "sharded_storage": sharded_numel, "after_read": after_read, "read_shape": list(read.shape),
        "read_matches": read_matches,
        "written": full["fc2.weight"].float().unique().tolist(), "bias": full["fc2.bias"].float().tolist(),
        "after_step": stepped["fc2.weight"].float().unique().tolist(),
        "bias_after_step": stepped["fc2.bias"].float().tolist(),
    }


@pytest.mark.parametrize("stage, dtype", [(3, "fp32"), (3, "bf16"), (1, "bf16")])
def test_gathered_parameters_read_and_write_through(stage, dtype, tmp_path):
    out = tmp_path / f"run-{stage}-{dtype}"
    out.mkdir()
    results = run_ranks(_gathered, 2, out, str(out))
    for rank, result in results.items():
        if stage == 3:
            assert result["sharded_storage"] == 0 and result["after_read"] == 0, "gathered only inside the block"
        assert result["read_shape"] == [17, 15] and result["read_matches"]
        assert result["written"] == [0.25], f"rank {rank} sees rank 0's write"
        assert result["bias"] == [float(i) for i in range(17)]
        # The master (its own fp32 tensor under bf16) took the write too: a step does not undo it.
        assert result["after_step"] == [0.25] and result["bias_after_step"] == result["bias"]


# -- zero.Init + from_pretrained-style loading ------------------------------------------------------
def _init_loading(rank: int, out_dir: str) -> dict:
    import zerorun.deepspeed as deepspeed

    torch.manual_seed(123)
    pretrained = Net().state_dict() if rank == 0 else None  # only rank 0 reads the file, as in HF
    with deepspeed.zero.Init(config_dict_or_path=ds_config(3)):
        model = Net()
    on_meta = all(p.is_meta for p in model.parameters())
    for prefix, module in model.named_modules():  # transformers' _load_state_dict_into_model
        params = list(module.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if rank == 0:
                for name, param in module.named_parameters(recurse=False):
                    with torch.no_grad():
                        param.copy_(pretrained[f"{prefix}.{name}" if prefix else name])
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config(3))
    loaded = engine.full_state_dict(rank0_only=False)
    torch.manual_seed(123)
    reference = Net().state_dict()
    losses = _train_steps(engine, 2)
    return {"on_meta": on_meta, "equal": all(torch.equal(loaded[k], reference[k]) for k in reference),
            "losses": losses, "sharded": all(p.untyped_storage().nbytes() == 0 for p in model.parameters())}


def test_zero_init_then_from_pretrained_style_loading(tmp_path):
    results = run_ranks(_init_loading, 2, tmp_path, str(tmp_path))
    for result in results.values():
        assert result["on_meta"] and result["equal"] and result["sharded"]
        assert all(loss == loss for loss in result["losses"])  # trains (finite losses)


# -- save / resume with client_state --------------------------------------------------------------
def _resume(rank: int, out_dir: str) -> dict:
    import zerorun.deepspeed as deepspeed
    from zerorun.deepspeed.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict, get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint)

    stage = int(Path(out_dir).name.split("-")[-1])
    save_dir = Path(out_dir) / "ckpt"

    def fresh():
        torch.manual_seed(7)
        model = Net()
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(stage))

    engine, _, _, scheduler = fresh()
    straight = _train_steps(engine, 6)
    engine, _, _, scheduler = fresh()
    first = _train_steps(engine, 3)
    engine.save_checkpoint(save_dir, client_state={"epoch": 1, "step": 3})
    consolidated = engine.full_state_dict(rank0_only=False)
    engine, _, _, scheduler = fresh()
    path, client_state = engine.load_checkpoint(save_dir)
    resumed = _train_steps(engine, 3, start=3)
    fp32 = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    if rank == 0:
        convert_zero_checkpoint_to_fp32_state_dict(save_dir, Path(out_dir) / "fp32")
        written = torch.load(Path(out_dir) / "fp32" / "pytorch_model.bin", weights_only=True)
        into = load_state_dict_from_zero_checkpoint(Net(), save_dir).state_dict()
        other_functions = all(torch.equal(written[k], fp32[k]) and torch.equal(into[k], fp32[k]) for k in fp32)
    else:
        other_functions = True
    return {
        "straight": straight, "resumed": first + resumed, "client_state": client_state,
        "global_steps": engine.global_steps, "lr": engine.get_lr(), "scheduler_lr": scheduler.get_last_lr(),
        "fp32_equal": sorted(fp32) == sorted(consolidated) and all(torch.equal(fp32[k], consolidated[k]) for k in fp32),
        "other_functions": other_functions,
    }


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_style_save_and_resume_is_bit_exact(stage, tmp_path):
    out = tmp_path / f"run-{stage}"
    out.mkdir()
    results = run_ranks(_resume, 2, out, str(out))
    for result in results.values():
        assert result["resumed"] == result["straight"]  # bit-exact: equal floats, step for step
        assert result["client_state"] == {"epoch": 1, "step": 3}
        assert result["global_steps"] == 6 and result["lr"] == result["scheduler_lr"]
        assert result["fp32_equal"] and result["other_functions"]


# -- ranks disagreeing on the folder ----------------------------------------------------------------
def _disagree(rank: int, out_dir: str) -> dict:
    import zerorun.deepspeed as deepspeed
    from zerorun.errors import CheckpointError

    model = Net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(2))
    _train_steps(engine, 1)
    try:  # HelloDeepSpeed names the folder by the current second: ranks can straddle one
        engine.save_checkpoint(Path(out_dir) / f"second-{40 + rank}")
        message = None
    except CheckpointError as error:
        message = str(error)
    return {"message": message, "written": sorted(p.name for p in Path(out_dir).iterdir()
                                                  if p.name.startswith("second-"))}


def test_ranks_saving_to_different_folders_get_one_clear_error(tmp_path):
    results = run_ranks(_disagree, 2, tmp_path, str(tmp_path))
    for result in results.values():
        assert result["message"].startswith("ranks disagree on the checkpoint folder: rank 0 saves to ")
        assert "second-40" in result["message"] and "rank 1 to " in result["message"]
        assert result["written"] == []  # checked before anything is written
