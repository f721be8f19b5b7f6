"""pytest tests/unit/test_estimate_rows_and_measure_errors.py — ``zerorun estimate`` rows and --measure errors.

A config's parameter offload belongs to the rows that offload: a row labelled "none" must show
the model's parameters on the GPU and nothing on NVMe, exactly as without the config. And
``--measure`` on a model whose forward needs more than the guessed input must say so and point
to ``example_batch`` in one line, not end in a bare TypeError.
"""

from __future__ import annotations

import pytest

from zerorun.cli.estimate import EstimateRequest, build_plan
from zerorun.errors import PlannerError


def _rows(**flags):
    base = dict(params="1B", preset=None, hf_config=None, model=None, gpus=4, nodes=None, hostfile=None, stage=None,
                precision=None, offload=None, config=None, micro_batch=None, seq_len=None,
                activation_checkpointing=None, gpu_memory=None, host_memory=None)
    plan = build_plan(EstimateRequest(**{**base, **flags}))
    return {(o.estimate.stage, o.estimate.offload): o.estimate for o in plan.options}


def test_rows_labelled_none_offload_nothing_whatever_the_config(tmp_path):
    config = tmp_path / "zr.yaml"
    config.write_text("zero:\n  stage: 3\n  offload_optimizer: {device: nvme, nvme_path: /tmp/x}\n"
                      "  offload_param: {device: nvme, nvme_path: /tmp/x}\n")
    reference_config = tmp_path / "plain.yaml"
    reference_config.write_text("zero:\n  stage: 3\n")
    with_config = _rows(config=config)
    plain = _rows(config=reference_config)
    for stage in (0, 1, 2, 3):
        row, reference = with_config[(stage, "none")], plain[(stage, "none")]
        assert row.nvme_per_node == 0 and row.params == reference.params, stage
    assert with_config[(3, "nvme")].params == 0  # where the config's offload applies, it does


MODEL = '''
import torch

class NeedsTargets(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, targets):
        return torch.nn.functional.mse_loss(self.proj(x), targets)

def build():
    return NeedsTargets()
'''


@pytest.mark.slow
def test_measure_on_a_forward_that_needs_targets_points_to_example_batch(tmp_path):
    from zerorun.cli.estimate import _run_measurement

    (tmp_path / "needs_targets.py").write_text(MODEL)
    request = EstimateRequest(model=f"{tmp_path / 'needs_targets.py'}:build")
    plan = build_plan(EstimateRequest(**dict(
        params=None, preset=None, hf_config=None, model=request.model, gpus=1, nodes=None, hostfile=None, stage=0,
        precision="fp32", offload=None, config=None, micro_batch=None, seq_len=None, activation_checkpointing=None,
        gpu_memory=None, host_memory=None)))
    with pytest.raises(PlannerError) as caught:
        _run_measurement(request, plan, 1, 1)
    message = str(caught.value)
    assert message.startswith("the model's forward refused the input --measure guessed ((2, 8)): ")
    assert "missing 1 required positional argument: 'targets'" in message and "define example_batch(" in message
    assert "\n" not in message
