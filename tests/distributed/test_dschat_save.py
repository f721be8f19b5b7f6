"""pytest tests/distributed/test_dschat_save.py — DeepSpeed-Chat's stage-3 save on zerorun.

DeepSpeed-Chat saves a ZeRO-3 model with its own ``save_zero_three_model`` (in its
``dschat/utils/utils.py``, vendored under tests/data/deepspeed_chat/): for each parameter, ``hasattr(p, "ds_id")`` says it is partitioned,
``p.ds_status == NOT_AVAILABLE`` says it must be fetched, ``deepspeed.zero.GatheredParameters``
gathers it and ``p.data.cpu()`` is kept. A tiny OPT (built from a config, nothing downloaded)
trains 3 AdamW steps at stage 3 on 2 gloo ranks, then is saved that way; the file must hold
exactly the trained weights (``engine.full_state_dict()``), which also match plain torch trained on
the same global batch (1e-4 relative, fp32). The same save with the ``ds_*`` attributes taken
away must fail: it is the attributes that make the save work.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from gloo_world import run_ranks

pytest.importorskip("transformers", reason="transformers is in the `test` extra")

WORLD = 2
STEPS = 3
VENDORED = Path(__file__).resolve().parents[1] / "data" / "deepspeed_chat" / "dschat" / "utils" / "utils.py"
ATTRIBUTES = ("ds_id", "ds_status", "ds_numel", "ds_shape", "ds_tensor", "ds_persist")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_stage3_use import build_model, global_batch, optimizer_for, train_reference  # noqa: E402


def load_dschat():
    """The vendored file, its ``deepspeed`` imports resolving to zerorun.deepspeed."""
    import zerorun.deepspeed as deepspeed

    for name, module in {"deepspeed": deepspeed, "deepspeed.runtime": deepspeed.runtime,
                         "deepspeed.runtime.zero": deepspeed.runtime.zero,
                         "deepspeed.runtime.zero.partition_parameters": deepspeed.runtime.zero.partition_parameters,
                         "deepspeed.accelerator": deepspeed.accelerator}.items():
        sys.modules.setdefault(name, module)
    spec = importlib.util.spec_from_file_location("dschat_utils", VENDORED)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def attribute_checks(engine) -> dict:
    """DeepSpeed's meanings, on the trained engine: status outside and inside a gather, full
    sizes, and ``ds_tensor`` as this rank's piece of the full value."""
    from zerorun.deepspeed import zero
    from zerorun.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = [p for p in engine.module.parameters() if p.requires_grad]
    checks = {"all_have_ids": all(hasattr(p, "ds_id") for p in params),
              "ids_unique": len({p.ds_id for p in params}) == len(params),
              "outside": sorted({p.ds_status.name for p in params})}
    pieces = 0
    for param in params:
        with zero.GatheredParameters([param]):
            assert param.ds_status is ZeroParamStatus.AVAILABLE
            assert param.ds_numel == param.numel() and param.ds_shape == param.shape
            full = param.data.reshape(-1)
            piece = param.ds_tensor
            # ds_tensor is a run of the full value's elements (which run: the unit's layout)
            found = any(torch.equal(full[i : i + piece.numel()], piece) for i in range(full.numel() - piece.numel() + 1))
            assert found, "ds_tensor is not a piece of the parameter"
            pieces += piece.numel()
    checks["pieces_numel"] = pieces
    checks["after"] = sorted({p.ds_status.name for p in params})
    return checks


def train_and_save(rank: int, out_dir: str) -> dict:
    import torch.distributed as dist

    import zerorun

    torch.set_num_threads(1)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    dschat = load_dschat()
    model = build_model("opt")
    engine = zerorun.initialize(model, optimizer_for(model), {
        "zero": {"stage": 3, "param_persistence_threshold": 0, "allgather_bucket_size": 3000}})
    losses = []
    for step in range(STEPS):
        ids = global_batch(step)[rank * 2 : (rank + 1) * 2]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    trained = {k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
    result: dict = {"losses": losses, "checks": attribute_checks(engine)}

    dschat.save_zero_three_model(engine, rank, f"{out_dir}/with", zero_stage=3)
    dist.barrier()
    if rank == 0:
        saved = torch.load(f"{out_dir}/with/pytorch_model.bin")
        result["saved_names"] = sorted(saved)
        result["mismatched"] = [k for k, v in saved.items() if not torch.equal(v, trained[k])]
        reference, result["reference_losses"] = train_reference("opt")  # plain torch, same global batch
        # k_proj's bias is left out: softmax ignores it, so its exact gradient is zero and
        # Adam turns either run's rounding noise into full-size steps of random sign.
        result["far_from_plain_torch"] = [
            k for k, v in reference.named_parameters()
            if not k.endswith("k_proj.bias") and not torch.allclose(saved[k], v.detach(), rtol=1e-4, atol=2e-5)]

    # The same save, the attributes gone: what DeepSpeed-Chat would do on a stage 3 without them.
    for param in engine.module.parameters():
        for name in ATTRIBUTES:
            if hasattr(param, name):
                delattr(param, name)
    try:  # only rank 0 writes, so only rank 0 can fail: no collective inside
        dschat.save_zero_three_model(engine, rank, f"{out_dir}/without", zero_stage=3)
        if rank == 0:
            saved = torch.load(f"{out_dir}/without/pytorch_model.bin")
            wrong = [k for k, v in saved.items() if not torch.equal(v, trained[k])]
            result["without"] = f"saved, {len(wrong)} of {len(saved)} tensors differ from the trained ones"
    except Exception as err:
        result["without"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0]}"
    dist.barrier()
    return result


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("dschat_save")
    return run_ranks(train_and_save, WORLD, out, str(out))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_save_zero_three_model_writes_the_trained_weights(results):
    result = results[0]
    assert result["saved_names"], "nothing saved"
    assert result["mismatched"] == []
    assert result["far_from_plain_torch"] == []
    for got, want in zip(result["losses"], result["reference_losses"], strict=True):
        assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_partitioned_parameters_carry_deepspeeds_attributes(results):
    total = sum(results[rank]["checks"]["pieces_numel"] for rank in range(WORLD))
    numel = sum(p.numel() for p in build_model("opt").parameters())  # the tied head counted once
    for rank in range(WORLD):
        checks = results[rank]["checks"]
        assert checks["all_have_ids"] and checks["ids_unique"]
        assert checks["outside"] == ["NOT_AVAILABLE"] and checks["after"] == ["NOT_AVAILABLE"]
    assert total == numel  # the ranks' ds_tensors together hold every element once


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_same_save_without_the_attributes_fails(results):
    # Without ds_id the function takes each parameter as it is (``v.cpu()``): a stage-3
    # placeholder whose unit is not gathered. Pickling it reads its values, which is refused
    # in one line naming the parameter (Note [reads outside forward] in zero/param_access.py)
    # instead of writing empty storages that fail only when the file is loaded.
    without = results[0]["without"]
    assert without.startswith("failed: UsageError: parameter 'model.decoder."), without
    assert "is partitioned by ZeRO stage 3" in without
