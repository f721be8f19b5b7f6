"""pytest tests/integrations/test_trainer_parity.py — ZerorunTrainer matches Trainer under DDP.

One spawned world of 2 gloo ranks trains the same tiny GPT-2 (tied embeddings) on the same data
with plain Trainer (DDP: Accelerate wraps it) and with ZerorunTrainer at stages 2 and 3, from a
DeepSpeed-style config whose batch sizes, accumulation, clipping, precision and bucket sizes are
all "auto" (filled from the same TrainingArguments). Accumulation 2, clipping at a norm the
gradients exceed (so clipping acts), linear warm-up and decay, weight decay on Trainer's two
parameter groups. A fourth run takes the optimizer from the config ("auto" hyper-parameters)
and is compared with a DDP run without weight decay (DeepSpeed's optimizer decays every
parameter, Trainer's spares biases and norms; at 0 both are the same). A last run takes the
scheduler from the config (built and stepped by the engine) against the same schedule in DDP.

Every run also evaluates and writes a model checkpoint at step 3, mid-training.

Compared, each at 1e-4 relative (fp32; sharded and DDP runs sum gradients in another order, so
values differ by float rounding, ~1e-7 per step; 1e-4 leaves room for Adam's amplification of
near-zero gradients): every logged loss and learning rate, the eval losses, and the weights
``save_model`` wrote, reloaded with ``from_pretrained`` (atol 2e-5 beside rtol: lr is 3e-3,
one wrong update moves a weight ~100x that). After stage-3 training, ``generate`` with
``synced_gpus=True`` and a different number of new tokens per rank gives DDP's tokens.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from hf_world import WORLD, TokenDataset, build_model, join_world, sequences, spawn, write_result

transformers = pytest.importorskip("transformers", minversion="5.23", reason="ZerorunTrainer needs transformers 5.23")
pytest.importorskip("accelerate", reason="accelerate is in the `test` extra")

LR = 3e-3
MAX_GRAD_NORM = 0.3
STEPS = 6
ZERO_AUTO = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    # Hugging Face's usual config carries the stage-3 keys at every stage; Trainer fills them only
    # at stage 3, so at stage 2 they reach the loader as "auto" (DeepSpeed's default applies).
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
}
OPTIMIZER_AUTO = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}


def _config(stage: int, optimizer: bool = False, scheduler: bool = False) -> dict:
    config = copy.deepcopy(ZERO_AUTO)
    config["zero_optimization"]["stage"] = stage
    if optimizer:
        config["optimizer"] = copy.deepcopy(OPTIMIZER_AUTO)
    if scheduler:
        config["scheduler"] = {"type": "LinearLR", "params": {"start_factor": 1.0, "end_factor": 0.5,
                                                              "total_iters": STEPS}}
    return config


RUNS = {
    # name: (zerorun config or None for DDP, weight decay, the DDP run it is compared with)
    "ddp": (None, 0.01, None),
    "stage2": (_config(2), 0.01, "ddp"),
    "stage3": (_config(3), 0.01, "ddp"),
    "ddp_no_decay": (None, 0.0, None),
    "stage3_config_optimizer": (_config(3, optimizer=True), 0.0, "ddp_no_decay"),
    # The engine builds and steps the config's scheduler: torch's LinearLR from 1x to 0.5x over
    # the run is Trainer's polynomial decay of power 1 to lr_end = 0.5 lr without warm-up.
    "ddp_polynomial": (None, 0.01, None),
    "stage2_config_scheduler": (_config(2, scheduler=True), 0.01, "ddp_polynomial"),
}
SCHEDULE_OVERRIDES = {
    "ddp_polynomial": dict(lr_scheduler_type="polynomial", warmup_steps=0,
                           lr_scheduler_kwargs={"lr_end": LR / 2, "power": 1.0}),
    "stage2_config_scheduler": dict(warmup_steps=0),
}


def training_arguments(output_dir: str, weight_decay: float, zerorun_config=None, **overrides):
    from zerorun.integrations.hf import ZerorunTrainingArguments

    settings = dict(
        output_dir=output_dir, use_cpu=True, ddp_backend="gloo", report_to="none", disable_tqdm=True,
        per_device_train_batch_size=2, per_device_eval_batch_size=3, gradient_accumulation_steps=2,
        learning_rate=LR, weight_decay=weight_decay, max_grad_norm=MAX_GRAD_NORM, warmup_steps=2,
        lr_scheduler_type="linear", max_steps=STEPS, logging_steps=1, seed=7,
        dataloader_num_workers=0, include_num_input_tokens_seen="no",
        # Mid-training evaluation and a model checkpoint (a gathering save) at step 3: training
        # goes on from both unchanged.
        eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=3, save_only_model=True,
    )
    settings.update(overrides)
    if zerorun_config is None:
        return transformers.TrainingArguments(**settings)
    return ZerorunTrainingArguments(zerorun=zerorun_config, **settings)


def prompt_for(rank: int) -> tuple[torch.Tensor, int]:
    """Each rank its own prompt and its own number of new tokens: ranks finish at different
    steps, which at stage 3 only synced_gpus survives."""
    return sequences(1, 900 + rank)[:, :4], 2 + 4 * rank


def run(name: str, rank: int, out_dir: str) -> dict:
    import torch.distributed as dist
    from transformers import Trainer

    from zerorun.integrations.hf import ZerorunTrainer

    zerorun_config, weight_decay, _ = RUNS[name]
    args = training_arguments(f"{out_dir}/{name}", weight_decay, zerorun_config, **SCHEDULE_OVERRIDES.get(name, {}))
    model = build_model()
    trainer_class = Trainer if zerorun_config is None else ZerorunTrainer
    trainer = trainer_class(model=model, args=args, train_dataset=TokenDataset(32, seed=1),
                            eval_dataset=TokenDataset(12, seed=2))
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    evals = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    metrics = trainer.evaluate()
    trainer.save_model(f"{out_dir}/{name}/final")
    trainer.model.eval()
    prompt, new_tokens = prompt_for(rank)
    with torch.no_grad():
        generated = trainer.model.generate(prompt, max_new_tokens=new_tokens, do_sample=False,
                                           synced_gpus=zerorun_config is not None, pad_token_id=0)
    dist.barrier()
    return {
        "loss": [e["loss"] for e in logs],
        "learning_rate": [e["learning_rate"] for e in logs],
        "grad_norm": [e.get("grad_norm") for e in logs],
        "eval_loss": metrics["eval_loss"],
        "evals_during_training": evals,
        "generated": generated[0].tolist(),
        "filled": getattr(args, "zerorun_config", None),
        # Proof the run trained on the engine, not on a DDP-wrapped model.
        "engine_stage": getattr(getattr(trainer, "engine", None), "stage", None),
        "wrapped": type(trainer.model_wrapped).__name__,
    }


def compare_saved(out_dir: str, name: str, reference: str) -> dict:
    from safetensors import safe_open
    from transformers import GPT2LMHeadModel

    files = sorted(Path(out_dir, name, "final").glob("*.safetensors"))
    keys = [key for path in files for key in safe_open(str(path), "pt").keys()]
    got = GPT2LMHeadModel.from_pretrained(f"{out_dir}/{name}/final").state_dict()
    want = GPT2LMHeadModel.from_pretrained(f"{out_dir}/{reference}/final").state_dict()
    initial = build_model().state_dict()
    worst, moved, problems = 0.0, math.inf, []
    for key, value in want.items():
        if not torch.allclose(got[key], value, rtol=1e-4, atol=2e-5):
            problems.append(f"{key}: max diff {(got[key] - value).abs().max().item():.3g}")
        worst = max(worst, (got[key] - value).abs().max().item())
        if value.is_floating_point() and key.endswith("weight"):
            moved = min(moved, (value - initial[key]).abs().max().item())
    return {"keys": keys, "worst_weight_diff": worst, "least_moved": moved, "problems": problems}


def worker(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    from zerorun.zero.comm.process_group import leaving_together

    join_world(rank, out_dir)
    with leaving_together():
        results = {}
        for name in RUNS:
            try:
                results[name] = run(name, rank, out_dir)
            except Exception as err:  # reported by that run's test, not as a crashed world
                import traceback

                results[name] = {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"}
            dist.barrier()
        if rank == 0:
            for name, (_config, _, reference) in RUNS.items():
                if reference is not None and "error" not in results[name]:
                    try:
                        results[name]["saved"] = compare_saved(out_dir, name, reference)
                    except Exception as err:
                        results[name]["saved"] = {"error": f"{type(err).__name__}: {err}"}
        write_result(out_dir, rank, results)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return spawn(worker, tmp_path_factory.mktemp("trainer_parity"))


def _relative(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


ZERORUN_RUNS = [name for name, (_, _, reference) in RUNS.items() if reference is not None]


@pytest.mark.slow
@pytest.mark.timeout(280)
@pytest.mark.parametrize("name", ZERORUN_RUNS)
def test_logged_losses_and_learning_rates_match_ddp(results, name):
    reference = RUNS[name][2]
    for rank in range(WORLD):
        got, want = results[rank][name], results[rank][reference]
        assert "error" not in want, want.get("error")
        assert "error" not in got, got.get("error")
        assert len(got["loss"]) == len(want["loss"]) == STEPS
        assert got["wrapped"] == "EngineModule" and want["wrapped"] == "DistributedDataParallel"
        assert got["engine_stage"] == RUNS[name][0]["zero_optimization"]["stage"]
        for key in ("loss", "learning_rate"):
            for step, (g, w) in enumerate(zip(got[key], want[key], strict=True)):
                assert g == pytest.approx(w, rel=1e-4), f"rank {rank} step {step} {key}: {g} vs {w}"
        # The comparison means something: the loss fell, clipping acted, the lr moved.
        assert want["loss"][-1] < want["loss"][0] - 0.1
        assert sum(norm > MAX_GRAD_NORM for norm in want["grad_norm"]) >= STEPS // 2
        for g, w in zip(got["grad_norm"], want["grad_norm"], strict=True):
            assert g == pytest.approx(w, rel=1e-3)
        assert len(set(want["learning_rate"])) > 2
        print(f"{name} rank {rank}: max rel loss diff "
              f"{max(_relative(g, w) for g, w in zip(got['loss'], want['loss'], strict=True)):.2e}, lr "
              f"{max(_relative(g, w) for g, w in zip(got['learning_rate'], want['learning_rate'], strict=True)):.2e}")


@pytest.mark.slow
@pytest.mark.timeout(280)
@pytest.mark.parametrize("name", ZERORUN_RUNS)
def test_eval_loss_matches_ddp(results, name):
    reference = RUNS[name][2]
    for rank in range(WORLD):
        got, want = results[rank][name], results[rank][reference]
        assert "error" not in got, got.get("error")
        assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-4)
        assert len(want["evals_during_training"]) == 2  # at steps 3 and 6
        assert got["evals_during_training"] == pytest.approx(want["evals_during_training"], rel=1e-4)
        print(f"{name} rank {rank}: eval loss rel diff {_relative(got['eval_loss'], want['eval_loss']):.2e}")


@pytest.mark.slow
@pytest.mark.timeout(280)
@pytest.mark.parametrize("name", ZERORUN_RUNS)
def test_saved_model_reloads_with_ddp_weights(results, name):
    got = results[0][name]
    assert "error" not in got, got.get("error")
    saved = got["saved"]
    assert "error" not in saved, saved.get("error")
    assert not saved["problems"], saved["problems"]
    # Tied input/output embeddings are written once.
    assert saved["keys"].count("transformer.wte.weight") == 1 and "lm_head.weight" not in saved["keys"]
    assert saved["least_moved"] > 50 * 2e-5, "a weight barely trained; the comparison is vacuous"
    print(f"{name}: worst reloaded weight diff {saved['worst_weight_diff']:.2e}")


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_stage3_generate_with_synced_gpus_matches_ddp(results):
    for rank in range(WORLD):
        got, want = results[rank]["stage3"], results[rank]["ddp"]
        assert "error" not in got, got.get("error")
        prompt, new_tokens = prompt_for(rank)
        assert len(got["generated"]) == prompt.shape[1] + new_tokens
        assert got["generated"] == want["generated"]


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_auto_values_were_filled_from_the_arguments(results):
    filled = results[0]["stage3"]["filled"]
    assert filled["train_micro_batch_size_per_gpu"] == 2
    assert filled["gradient_accumulation_steps"] == 2
    assert filled["train_batch_size"] == 2 * 2 * WORLD
    assert filled["gradient_clipping"] == MAX_GRAD_NORM
    assert filled["bf16"]["enabled"] is False and filled["fp16"]["enabled"] is False
