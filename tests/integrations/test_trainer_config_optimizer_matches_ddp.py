"""pytest tests/integrations/test_trainer_config_optimizer_matches_ddp.py — ZerorunTrainer with a config optimizer and weight decay matches Trainer under DDP.

Reuses the parity harness of test_trainer_parity.py (the same tiny GPT-2, data, arguments and
2-rank gloo world): stage 3, accumulation 2, an "optimizer" section whose weight decay is 0.1
("auto", filled from weight_decay=0.1). The config's optimizer is built over Trainer's own decay
groups, so biases and LayerNorm weights are spared decay exactly as under plain Trainer. Before, it
decayed every parameter (as HF with DeepSpeed does) and the weights differed from
DDP's by ~1e-3 after a few steps.

Also checked: the loss the engine reports to telemetry (what the dashboard and metrics.jsonl
show), averaged over ranks as Trainer averages its logged loss, equals Trainer's logged loss
every step; before, it was half of it under accumulation 2, and no
ConfigPrecedenceWarning is raised when the optimizer comes from the config.

Tolerances: logged losses 1e-5 relative, saved weights 1e-5 (absolute and relative).
"""

from __future__ import annotations

import warnings

import pytest

import test_trainer_parity as parity
from hf_world import WORLD, join_world, spawn, write_result

pytest.importorskip("transformers", minversion="5.23", reason="ZerorunTrainer needs transformers 5.23")
pytest.importorskip("accelerate", reason="accelerate is in the `test` extra")

RUNS = {
    "ddp_decay": (None, 0.1, None),
    "stage3_config_optimizer_decay": (parity._config(3, optimizer=True), 0.1, "ddp_decay"),
}


class _Capture:
    """A telemetry recorder that keeps the losses the engine reports."""

    enabled = True

    def __init__(self):
        self.losses = []

    def record_step(self, *, loss=None, **fields):
        self.losses.append(loss)

    def set_memory_breakdown(self, breakdown):
        pass

    def set_total_steps(self, total_steps):
        pass

    def observe_collectives(self):
        pass  # get_recorder() subscribes the process's recorder to the collectives; this one keeps losses only

    def record_activity(self, what, nbytes):
        pass


def worker(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    import zerorun.telemetry as telemetry
    from zerorun.config.precedence import ConfigPrecedenceWarning
    from zerorun.zero.comm.process_group import leaving_together

    parity.RUNS.update(RUNS)
    join_world(rank, out_dir)
    with leaving_together():
        results = {}
        for name in RUNS:
            capture = telemetry._recorder = _Capture()
            telemetry._created = True
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    results[name] = parity.run(name, rank, out_dir)
                except Exception as err:  # reported by the tests, not as a crashed world
                    import traceback

                    results[name] = {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"}
            results[name]["recorded"] = capture.losses
            results[name]["precedence_warnings"] = [str(w.message) for w in caught
                                                    if issubclass(w.category, ConfigPrecedenceWarning)]
            dist.barrier()
        if rank == 0 and "error" not in results["stage3_config_optimizer_decay"]:
            saved = parity.compare_saved(out_dir, "stage3_config_optimizer_decay", "ddp_decay")
            results["stage3_config_optimizer_decay"]["saved"] = saved
        write_result(out_dir, rank, results)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return spawn(worker, tmp_path_factory.mktemp("trainer_config_optimizer"))


_relative = parity._relative


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_config_optimizer_with_weight_decay_matches_ddp_losses(results):
    worst = 0.0
    for rank in range(WORLD):
        got, want = results[rank]["stage3_config_optimizer_decay"], results[rank]["ddp_decay"]
        assert "error" not in want, want.get("error")
        assert "error" not in got, got.get("error")
        assert got["engine_stage"] == 3 and got["wrapped"] == "EngineModule"
        assert got["filled"]["optimizer"]["params"]["weight_decay"] == 0.1
        assert len(got["loss"]) == len(want["loss"]) == parity.STEPS
        for step, (g, w) in enumerate(zip(got["loss"], want["loss"], strict=True)):
            assert g == pytest.approx(w, rel=1e-5), f"rank {rank} step {step}: {g} vs {w}"
            worst = max(worst, _relative(g, w))
        assert want["loss"][-1] < want["loss"][0] - 0.1
    print(f"max relative logged-loss difference {worst:.2e}")


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_config_optimizer_with_weight_decay_matches_ddp_weights(results):
    got = results[0]["stage3_config_optimizer_decay"]
    assert "error" not in got, got.get("error")
    saved = got["saved"]
    assert saved["worst_weight_diff"] < 1e-5, saved
    assert saved["least_moved"] > 100 * 1e-5, "a weight barely trained; the comparison is vacuous"
    print(f"worst saved weight difference {saved['worst_weight_diff']:.2e}")


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_recorded_loss_is_trainers_logged_loss(results):
    name = "stage3_config_optimizer_decay"
    per_rank = [results[rank][name]["recorded"] for rank in range(WORLD)]
    assert all(len(r) == parity.STEPS for r in per_rank), per_rank
    mean = [sum(values) / WORLD for values in zip(*per_rank, strict=True)]
    logged = results[0][name]["loss"]
    worst = max(_relative(m, w) for m, w in zip(mean, logged, strict=True))
    assert worst < 1e-5, (mean, logged)
    print(f"recorded vs logged loss: max relative difference {worst:.2e}")


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_no_precedence_warning_when_the_optimizer_comes_from_the_config(results):
    for rank in range(WORLD):
        assert results[rank]["stage3_config_optimizer_decay"]["precedence_warnings"] == []
