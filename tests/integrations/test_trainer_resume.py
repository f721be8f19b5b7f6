"""pytest tests/integrations/test_trainer_resume.py — ZerorunTrainer checkpoints: a resumed run
matches an uninterrupted one, and load_best_model_at_end loads the best checkpoint.

2 gloo ranks, stage 3, the tiny GPT-2 of hf_world.py. The uninterrupted run trains 6 steps,
evaluating and checkpointing (model + the engine's sharded checkpoint + the Trainer's scheduler
state) every 3; a second trainer resumes from checkpoint-3 and must log the same losses and
learning rates for steps 4-6 (1e-4 relative). The best model is chosen by the *highest* eval
loss, so it is the earlier checkpoint and loading it is visible: evaluating after training gives
that checkpoint's eval loss, not the last one's.
"""

from __future__ import annotations

import copy

import pytest

from hf_world import WORLD, TokenDataset, build_model, join_world, spawn, write_result

transformers = pytest.importorskip("transformers", minversion="5.23", reason="ZerorunTrainer needs transformers 5.23")
pytest.importorskip("accelerate", reason="accelerate is in the `test` extra")

CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def trainer_for(out_dir: str):
    from zerorun.integrations.hf import ZerorunTrainer, ZerorunTrainingArguments

    args = ZerorunTrainingArguments(
        output_dir=f"{out_dir}/run", zerorun=copy.deepcopy(CONFIG), use_cpu=True, ddp_backend="gloo",
        report_to="none", disable_tqdm=True, per_device_train_batch_size=2, per_device_eval_batch_size=3,
        gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.01, max_grad_norm=0.3,
        warmup_steps=2, max_steps=6, logging_steps=1, seed=7, eval_strategy="steps", eval_steps=3,
        save_strategy="steps", save_steps=3, load_best_model_at_end=True, metric_for_best_model="eval_loss",
        greater_is_better=True, include_num_input_tokens_seen="no")
    return ZerorunTrainer(model=build_model(), args=args, train_dataset=TokenDataset(32, seed=1),
                          eval_dataset=TokenDataset(12, seed=2))


def train_logs(trainer) -> dict:
    history = trainer.state.log_history
    return {
        "train": {e["step"]: [e["loss"], e["learning_rate"]] for e in history if "loss" in e},
        "eval": {e["step"]: e["eval_loss"] for e in history if "eval_loss" in e},
    }


def worker(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    from zerorun.zero.comm.process_group import leaving_together

    join_world(rank, out_dir)
    with leaving_together():
        result = {}
        try:
            whole = trainer_for(out_dir)
            whole.train()
            result["whole"] = train_logs(whole)
            result["after_best"] = whole.evaluate()["eval_loss"]
            result["best_checkpoint"] = whole.state.best_model_checkpoint
            dist.barrier()
            resumed = trainer_for(out_dir)
            resumed.train(resume_from_checkpoint=f"{out_dir}/run/checkpoint-3")
            result["resumed"] = train_logs(resumed)
        except Exception as err:  # the same on every rank: raised before any collective
            result["error"] = f"{type(err).__name__}: {err}"
        write_result(out_dir, rank, result)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return spawn(worker, tmp_path_factory.mktemp("trainer_resume"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resumed_run_matches_uninterrupted_run(results):
    for rank in range(WORLD):
        result = results[rank]
        assert "error" not in result, result.get("error")
        whole, resumed = result["whole"]["train"], result["resumed"]["train"]
        # The resumed history starts with the checkpoint's own (steps 1-3), then its new steps.
        assert sorted(resumed) == ["1", "2", "3", "4", "5", "6"]
        for step in ("4", "5", "6"):
            assert resumed[step] == pytest.approx(whole[step], rel=1e-4), f"rank {rank} step {step}"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_load_best_model_at_end_loads_the_best_checkpoint(results):
    for rank in range(WORLD):
        result = results[rank]
        assert "error" not in result, result.get("error")
        evals = result["whole"]["eval"]
        assert result["best_checkpoint"].endswith("checkpoint-3")
        assert evals["3"] != pytest.approx(evals["6"], rel=1e-3), "the two checkpoints are alike: vacuous"
        assert result["after_best"] == pytest.approx(evals["3"], rel=1e-4)
