"""pytest tests/unit/test_deepspeed_module.py — zerorun.deepspeed's module-level names, no process group.

One test per row of docs/deepspeed.md's table that needs no engine: each does what DeepSpeed's
name does (signature, return value, side effects); every unsupported name imports and fails on
first use with one clear error naming the feature; a DeepSpeed config's optimizer takes
DeepSpeed's defaults for what it leaves out.
"""

from __future__ import annotations

import argparse
import logging
import random

import pytest
import torch

import zerorun.deepspeed as deepspeed
from zerorun.config import load_config
from zerorun.deepspeed.accelerator import CpuAccelerator, CudaAccelerator, accelerator_kind, get_accelerator
from zerorun.deepspeed.comm import discover
from zerorun.errors import ConfigError, RuntimeConfigError, UnsupportedFeature

from deepspeed_alone import alone  # noqa: F401  (a fixture)


# -- add_config_arguments ---------------------------------------------------------------------------
def test_add_config_arguments_adds_deepspeeds_flags_and_the_launchers_local_rank():
    parser = argparse.ArgumentParser()
    assert deepspeed.add_config_arguments(parser) is parser
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json", "--local_rank=1"])
    assert (args.deepspeed, args.deepspeed_config, args.local_rank, args.deepscale) == (True, "ds.json", 1, False)
    assert parser.parse_args([]).local_rank == -1  # DeepSpeed's examples read -1 as "not distributed"


def test_add_config_arguments_keeps_a_scripts_own_local_rank():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-7)
    deepspeed.add_config_arguments(parser)  # no argparse conflict
    assert parser.parse_args([]).local_rank == -7


# -- accelerator ------------------------------------------------------------------------------------
def test_accelerator_follows_ds_accelerator_then_the_launchers_device():
    assert accelerator_kind({"DS_ACCELERATOR": "cuda", "ZERORUN_DEVICE": "cpu"}) == "cuda"
    assert accelerator_kind({"ZERORUN_DEVICE": "cpu"}) == "cpu"
    assert accelerator_kind({"ZERORUN_DEVICE": "cuda:1"}) == "cuda"


def test_cpu_accelerator_answers_as_deepspeeds(monkeypatch):
    monkeypatch.setenv("ZERORUN_DEVICE", "cpu")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    acc = get_accelerator()
    assert isinstance(acc, CpuAccelerator) and not isinstance(acc, CudaAccelerator)
    assert acc.device_name(1) == "cpu" and acc.current_device_name() == "cpu"
    assert acc.communication_backend_name() == "gloo" and acc.is_available() and acc.is_bf16_supported()
    acc.set_device(1)  # a no-op, as DeepSpeed's CPU accelerator
    acc.synchronize()
    acc.empty_cache()
    acc.manual_seed_all(5)
    first = torch.rand(3)
    acc.manual_seed_all(5)
    assert torch.equal(first, torch.rand(3))


def test_cuda_accelerator_names_devices_like_deepspeed():
    acc = CudaAccelerator()
    assert acc.device_name() == "cuda" and acc.device_name(3) == "cuda:3"
    assert acc.device(2) == torch.device("cuda", 2) and acc.communication_backend_name() == "nccl"


# -- comm / init_distributed --------------------------------------------------------------------------
@pytest.mark.parametrize("environ, expected", [
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "9"},
     {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "9"}),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1"},
     {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "MASTER_ADDR": "m"},
     {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "m", "MASTER_PORT": "29500"}),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "7"},
     {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "m", "MASTER_PORT": "7"}),
    ({}, {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": ""}),
], ids=["torchrun", "slurm", "openmpi", "mpich", "alone"])
def test_init_distributed_discovers_ranks_like_deepspeed(environ, expected):
    assert discover(environ) == expected


def test_comm_before_the_group_exists_says_what_to_call(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    from zerorun.errors import LaunchError

    with pytest.raises(LaunchError, match=r"deepspeed.comm.get_rank\(\) needs the process group") as caught:
        deepspeed.comm.get_rank()
    assert "init_distributed" in caught.value.hint
    assert deepspeed.comm.is_initialized() is False
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert deepspeed.comm.get_local_rank() == 3


def test_init_distributed_on_a_multi_rank_env_without_master_addr_is_one_clear_error(monkeypatch):
    from zerorun.errors import LaunchError

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.delenv("SLURM_LAUNCH_NODE_IPADDR", raising=False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(LaunchError, match="this is rank 0 of 2 but no MASTER_ADDR is set"):
        deepspeed.init_distributed()


# -- ops ---------------------------------------------------------------------------------------------
def test_fused_adam_and_cpu_adam_are_torch_adamw_with_deepspeeds_defaults():
    params = [torch.nn.Parameter(torch.zeros(3))]
    for optimizer in (deepspeed.ops.adam.FusedAdam(params), deepspeed.ops.adam.DeepSpeedCPUAdam(params)):
        group = optimizer.param_groups[0]
        assert type(optimizer) is torch.optim.AdamW and group["fused"] is True
        assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert type(deepspeed.ops.adam.FusedAdam(params, adam_w_mode=False)) is torch.optim.Adam
    assert type(deepspeed.ops.adam.DeepSpeedCPUAdam(params, adamw_mode=False)) is torch.optim.Adam
    with pytest.raises(RuntimeConfigError, match="bias_correction=False"):
        deepspeed.ops.adam.FusedAdam(params, bias_correction=False)


# -- utils and runtime.utils --------------------------------------------------------------------------
def test_repeating_loader_starts_again_when_exhausted():
    loader = deepspeed.utils.RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    assert iter(loader) is loader


def test_logger_and_log_dist(caplog):
    assert isinstance(deepspeed.utils.logger, logging.Logger)
    deepspeed.utils.logger.propagate = True  # let caplog see it
    try:
        with caplog.at_level(logging.INFO, logger=deepspeed.utils.logger.name):
            deepspeed.utils.log_dist("on rank 0", ranks=[0])
            deepspeed.utils.log_dist("on rank 1 only", ranks=[1])
    finally:
        deepspeed.utils.logger.propagate = False
    assert "[Rank 0] on rank 0" in caplog.text and "rank 1 only" not in caplog.text


def test_set_random_seed_seeds_python_and_torch():
    from zerorun.deepspeed.runtime.utils import set_random_seed

    set_random_seed(11)
    first = (random.random(), torch.rand(2))
    set_random_seed(11)
    again = (random.random(), torch.rand(2))
    assert first[0] == again[0] and torch.equal(first[1], again[1])


def test_lr_schedules_are_zeroruns_deepspeed_schedules():
    from zerorun import schedulers
    from zerorun.deepspeed.runtime.lr_schedules import WarmupLR

    assert WarmupLR is schedulers.WarmupLR


# -- what is refused -----------------------------------------------------------------------------------
def _use_moe():
    from zerorun.deepspeed.moe.layer import MoE

    MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2)


def _use_pipe():
    from zerorun.deepspeed.pipe import LayerSpec, PipelineModule

    PipelineModule(layers=[LayerSpec(torch.nn.Linear, 2, 2)], num_stages=2)


def _subclass_pipe():
    class Mine(deepspeed.pipe.PipelineModule):
        pass


def _use_tp():
    deepspeed.tp_model_init(torch.nn.Linear(2, 2), tp_size=2, dtype=torch.float32)


def _use_sequence():
    from zerorun.deepspeed.sequence.layer import DistributedAttention

    DistributedAttention(None, None)


def _use_compression():
    from zerorun.deepspeed.compression.compress import init_compression

    init_compression(torch.nn.Linear(2, 2), "ds_config.json")


def _use_lamb():
    from zerorun.deepspeed.ops.lamb import FusedLamb

    FusedLamb([torch.nn.Parameter(torch.zeros(2))])


def _use_mpu():
    deepspeed.initialize(model=torch.nn.Linear(2, 2), mpu=object(), config={"train_batch_size": 1})


@pytest.mark.parametrize("use, feature", [
    (_use_moe, "deepspeed.moe.layer.MoE is not supported: zerorun has no mixture-of-experts (MoE) layers"),
    (_use_pipe, "deepspeed.pipe.LayerSpec is not supported: zerorun has no pipeline parallelism"),
    (_subclass_pipe, "deepspeed.pipe.PipelineModule is not supported: zerorun has no pipeline parallelism"),
    (_use_tp, "deepspeed.tp_model_init is not supported: zerorun has no tensor parallelism (AutoTP)"),
    (_use_sequence, "deepspeed.sequence.layer.DistributedAttention is not supported: zerorun has no sequence "
                    "parallelism (Ulysses)"),
    (_use_compression, "deepspeed.compression.compress.init_compression is not supported: zerorun has no model "
                       "compression"),
    (_use_lamb, "deepspeed.ops.lamb.FusedLamb is not supported: zerorun has no LAMB optimizer"),
    (_use_mpu, "deepspeed.initialize(mpu=...) is not supported: zerorun has no model parallelism"),
], ids=["moe", "pipe", "pipe-subclass", "tensor-parallel", "sequence-parallel", "compression", "lamb", "mpu"])
def test_each_unsupported_name_imports_and_fails_on_use_naming_the_feature(use, feature):
    with pytest.raises(UnsupportedFeature) as caught:
        use()
    message = str(caught.value)
    assert message.startswith(feature) and "\n" not in message
    assert "data-parallel" in caught.value.hint


def test_a_deepspeed_name_zerorun_does_not_map_is_one_clear_line():
    with pytest.raises(AttributeError, match="zerorun.deepspeed has no 'autotuning': a DeepSpeed name zerorun "
                                             "does not map"):
        deepspeed.autotuning  # noqa: B018


def test_moe_helpers_answer_as_deepspeed_does_for_a_model_without_moe_layers():
    from zerorun.deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

    group = {"params": [torch.nn.Parameter(torch.zeros(1))], "name": "parameters"}
    assert split_params_into_different_moe_groups_for_optimizer(group) == [group]
    assert split_params_into_different_moe_groups_for_optimizer((group,)) == [group]
    assert not is_moe_param(group["params"][0])


# -- a DeepSpeed config's optimizer defaults -------------------------------------------------------------
@pytest.mark.parametrize("ds_type, torch_class, defaults", [
    # DeepSpeed's FusedAdam/CPUAdam: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0, decoupled.
    ("Adam", torch.optim.AdamW, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}),
    ("AdamW", torch.optim.AdamW, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}),
    # DeepSpeed builds torch's own SGD and Adagrad: torch's defaults are DeepSpeed's.
    ("SGD", torch.optim.SGD, {"lr": 1e-3, "momentum": 0, "weight_decay": 0, "nesterov": False, "dampening": 0}),
    ("Adagrad", torch.optim.Adagrad, {"lr": 1e-2, "weight_decay": 0, "eps": 1e-10, "lr_decay": 0}),
])
@pytest.mark.usefixtures("alone")
def test_left_out_optimizer_params_take_deepspeeds_defaults(ds_type, torch_class, defaults):
    model = torch.nn.Linear(3, 2)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(),
        config={"train_batch_size": 1, "optimizer": {"type": ds_type, "params": {}}})
    assert type(optimizer) is torch_class
    group = optimizer.param_groups[0]
    assert {key: group[key] for key in defaults} == defaults


def test_lamb_in_a_config_is_refused_when_loaded():
    with pytest.raises(ConfigError, match="DeepSpeed-only optimizer"):
        load_config({"train_batch_size": 1, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, environ={})


# -- issue 31 item 10 ----------------------------------------------------------------------------
def test_deepspeed_checkpointing_recomputes_with_the_plain_gradients():
    """``deepspeed.checkpointing`` was a plain AttributeError; Megatron-style models call it."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(7, 7), torch.nn.Dropout(0.3), torch.nn.Tanh())
    x = torch.randn(5, 7)
    deepspeed.checkpointing.configure(None, partition_activations=True, checkpoint_in_cpu=True)
    assert deepspeed.checkpointing.is_configured()
    torch.manual_seed(1)
    deepspeed.checkpointing.checkpoint(block, x).sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    torch.manual_seed(1)
    block(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, block.parameters(), strict=True))
    with pytest.raises(UnsupportedFeature, match="model parallelism"):
        deepspeed.checkpointing.configure(object())
    with pytest.raises(UnsupportedFeature, match="model-parallel activation checkpointing"):
        deepspeed.checkpointing.model_parallel_cuda_manual_seed(1)


@pytest.mark.parametrize("code", [
    "import zerorun.deepspeed as deepspeed\ndeepspeed.moe.layer.MoE(hidden_size=4, expert=None, num_experts=2)",
    "import zerorun.deepspeed as deepspeed\ndeepspeed.PipelineModule(layers=[], num_stages=2)",
])
def test_a_refusal_before_initialize_is_one_line_not_a_traceback(tmp_path, code):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("zerorun: error: deepspeed.") and "is not supported" in lines[0], done.stderr
    assert len(lines) == 2 and lines[1].startswith("zerorun: hint: "), done.stderr


def test_peer_exited_is_one_line_on_the_surviving_rank(capsys):
    from zerorun.errors import ZerorunError
    from zerorun.zero.comm import process_group
    from zerorun.zero.comm.host_channel import PeerExited

    assert issubclass(PeerExited, ZerorunError) and issubclass(PeerExited, RuntimeError)
    process_group._watch_for_uncaught_exceptions()
    error = PeerExited("rank 1 (pid 4242) exited while this rank waited for it in a collective")
    import sys

    sys.excepthook(PeerExited, error, None)
    err = capsys.readouterr().err  # (an earlier test's process group may prefix "[rank0]: ")
    assert err.count("\n") == 1 and err.endswith("zerorun: error: rank 1 (pid 4242) exited while this rank waited "
                                                  "for it in a collective\n"), err
