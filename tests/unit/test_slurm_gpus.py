"""pytest tests/unit/test_slurm_gpus.py — ``--gpus N`` under Slurm is checked against the allocation
before anything starts: one line, not a traceback per rank 15 s later.

The environments are test_slurm.py's, recorded on a real Slurm 22.05 (no GPUs there).
"""

from __future__ import annotations

import pytest
from test_slurm import BATCH, SALLOC, SRUN_TASK
from test_slurm_launch import job_dir  # noqa: F401  (the fixture)

from zerorun.errors import LaunchError
from zerorun.launch import slurm
from zerorun.launch.prepare import LaunchOptions, prepare
from zerorun.launch.plan import Target


def prep(directory, environ, gpu_counter=lambda: 0, **options):
    return prepare(LaunchOptions(target=Target(script="train.py"), **options), environ=environ, cwd=str(directory),
                   gpu_counter=gpu_counter)


def never():
    raise AssertionError("counted GPUs where Slurm already said how many")


@pytest.mark.parametrize("environ, visible, asked, problem", [
    ({"SLURM_GPUS_ON_NODE": "4"}, never, 4, None),
    ({"SLURM_GPUS_ON_NODE": "2"}, never, 4, "has 2 (SLURM_GPUS_ON_NODE)"),
    ({"SLURM_GPUS_PER_NODE": "h100:2"}, never, 3, "has 2 (SLURM_GPUS_PER_NODE)"),
    ({"SLURMD_NODENAME": "n1"}, lambda: 0, 2, "has 0 (GPUs visible on n1)"),  # the batch script, no gres
    ({"SLURMD_NODENAME": "n1"}, lambda: 8, 2, None),
    ({}, never, 2, None),  # a salloc shell on the submit host that names no GPUs: unknown, not refused
])
def test_gpus_against_the_allocation(environ, visible, asked, problem):
    found = slurm.gpus_problem(asked, environ, visible)
    assert found == problem if problem is None else problem in found


@pytest.mark.parametrize("environ", [BATCH, SRUN_TASK])
def test_gpus_beyond_the_allocation_stop_the_launch_in_one_line(job_dir, environ):  # noqa: F811
    with pytest.raises(LaunchError) as caught:
        prep(job_dir, environ, gpus=2, gpu_counter=lambda: 0)
    assert "--gpus 2 asks for 2 GPU(s) per node but the Slurm allocation has 0" in caught.value.message
    assert "\n" not in caught.value.message and "--nproc" in caught.value.hint


def test_gpus_within_the_allocation_plan_as_before(job_dir):  # noqa: F811
    job = prep(job_dir, {**SALLOC, "SLURM_GPUS_ON_NODE": "2"}, gpus=2)
    assert [w.env["ZERORUN_DEVICE"] for w in job.plan.workers] == ["cuda:0", "cuda:1"] * 2
