"""pytest tests/unit/test_planner_traffic.py — the bytes per step per rank of zerorun/planner/traffic.py
and ``zerorun estimate --link``.

The formulas of traffic.py's docstring for 2 hosts x 1 rank (everything on the link) and 2 x 2
(a ring crosses hosts on 2 of its 4 edges; qgZ's exchange sends 2 of its 3 parts off the host),
stage 3's backward not regathering the unit forward used last (the head), frozen parameters
(gathered at stage 3, never reduced), the link time, and the CLI: a table with every stage and option, and a bad rate refused in one
line with a non-zero exit. docs/benchmarks.md compares these figures with what
scripts/bench_link.py counted on a shaped link.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from zerorun.cli.main import build_app, main
from zerorun.errors import PlannerError
from zerorun.planner.memory import Job
from zerorun.planner.traffic import all_traffic, parse_rate, step_traffic

PSI = 33_674_240  # the benchmark GPT


def test_two_hosts_one_rank_each():
    job = Job(gpus_per_node=1, nodes=2)
    q = 1 + 4 / 2048
    expected = {"stage 0": 4 * PSI, "stage 1": 4 * PSI, "stage 2": 4 * PSI, "stage 2+qgz": 2 * PSI + PSI / 2 * q,
                "stage 3": 6 * PSI, "stage 3+qwz": 2 * PSI + PSI * q, "stage 3+qgz": 4 * PSI + PSI / 2 * q,
                "stage 3+qwz+qgz": 1.5 * PSI * q}
    rows = {row.label: row for row in all_traffic(PSI, job, 4)}
    assert set(rows) == set(expected)
    for label, link in expected.items():
        assert rows[label].link_bytes == pytest.approx(link), label
        assert rows[label].local_bytes == 0
    assert rows["stage 3+qwz+qgz"].link_bytes / rows["stage 0"].link_bytes == pytest.approx(0.375 * q)
    assert rows["stage 0"].link_seconds(300e6, 1) == pytest.approx(4 * PSI * 8 / 300e6)  # 3.59 s


def test_two_hosts_two_ranks_each():
    job = Job(gpus_per_node=2, nodes=2)
    ring = 3 / 4 * PSI * 4  # one fp32 ring collective: (N-1)/N of the buffer
    stage3 = step_traffic(PSI, job, 3, 4)
    assert stage3.link_bytes == pytest.approx(3 * ring / 2) and stage3.local_bytes == pytest.approx(3 * ring / 2)
    qgz = step_traffic(PSI, job, 3, 4, qgz=True, block=PSI)  # one block: 4 bytes of scale
    exchange = 3 / 4 * PSI * (1 + 4 / PSI)
    assert qgz.link_bytes == pytest.approx(2 * ring / 2 + exchange * 2 / 3)
    assert step_traffic(PSI, job, 3, 4).link_seconds(1e9, 2) == pytest.approx(3 * ring / 2 * 2 * 8 / 1e9)


def test_stage3_keeps_the_head_gathered_into_backward():
    from zerorun.planner.presets import preset_spec
    from zerorun.planner.traffic import kept_numel

    spec = preset_spec("gpt-bench")
    assert spec.num_params == PSI  # examples/gpt.py's bench preset, counted by formula
    kept = kept_numel(spec.shape)
    assert kept == 16384 * 512 and kept_numel(None) == 0
    row = step_traffic(PSI, Job(gpus_per_node=1, nodes=2), 3, 4, kept=kept)
    assert row.link_bytes == pytest.approx((3 * PSI - kept) / 2 * 4)  # 185.3 MB: the benchmark counted 185.4
    # A prefetch budget keeps backward's first units too (Note [forward runs on into backward]):
    # 12e6 elements, 161.3 MB; the benchmark counted 164.5 (whole units fit under the budget).
    budget = kept_numel(spec.shape, 12_000_000, PSI)
    assert budget == kept + 12_000_000 and kept_numel(spec.shape, 10**12, PSI) == PSI
    row = step_traffic(PSI, Job(gpus_per_node=1, nodes=2), 3, 4, kept=budget)
    assert row.link_bytes / 1e6 == pytest.approx(164.5, rel=0.05)


def test_frozen_parameters_are_gathered_at_stage_3_and_never_reduced():
    """A LoRA-like model, a tenth of it trained, 2 hosts x 1 rank: below stage 3 the frozen
    parameters are whole on every rank and never sent; stage 3 gathers them (Note [frozen
    units] in zero/unit/partition.py) and reduce-scatters the trained ones' gradients only."""
    job, trained = Job(gpus_per_node=1, nodes=2), PSI // 10
    rows = {row.label: row for row in all_traffic(PSI, job, 4, trained=trained)}
    for stage in ("stage 0", "stage 1", "stage 2"):
        assert rows[stage].link_bytes == pytest.approx(4 * trained), stage  # 2 x (N-1)/N x 4 bytes
    assert rows["stage 3"].link_bytes == pytest.approx(2 * 2 * PSI + 2 * trained)
    assert rows["stage 3+qgz"].link_bytes == pytest.approx(2 * 2 * PSI + trained / 2 * (1 + 4 / 2048))
    hpz = {row.label: row for row in all_traffic(PSI, Job(gpus_per_node=2, nodes=2), 4, trained=trained)}
    everything = {row.label: row for row in all_traffic(PSI, Job(gpus_per_node=2, nodes=2), 4)}
    # hpZ's forward gathers every parameter over the world; its reduce-scatter only the trained
    forward_link = 3 / 4 * PSI * 4 * 2 / 4
    assert everything["stage 3+hpz"].link_bytes - forward_link == pytest.approx(
        (hpz["stage 3+hpz"].link_bytes - forward_link) * PSI / trained)


def test_one_host_sends_nothing_on_a_link():
    assert step_traffic(PSI, Job(gpus_per_node=4), 3, 2, qgz=True).link_bytes == 0


@pytest.mark.parametrize(("text", "bps"), [("300Mbit", 300e6), ("1gbit", 1e9), ("25Gbit/s", 25e9), ("500kbit", 5e5)])
def test_rates(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["fast", "300", "0Mbit", "-1Gbit", "Mbit"])
def test_bad_rates(text):
    with pytest.raises(PlannerError, match="is not a rate"):
        parse_rate(text)


def _main(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    return exit_info.value.code or 0, captured.out + captured.err


def test_estimate_link_table_and_errors(capsys):
    result = CliRunner().invoke(build_app(), ["estimate", "--params", str(PSI), "--nodes", "2", "--precision", "fp32",
                                              "--link", "300Mbit", "--compute-s", "1.5"])
    assert result.exit_code == 0, result.output
    assert "stage 3+qwz+qgz" in result.output and "134.7" in result.output and "202.0" in result.output
    code, out = _main(["estimate", "--params", "1B", "--nodes", "2", "--link", "fast"], capsys)
    assert code != 0 and "is not a rate" in out and "Traceback" not in out and len(out.strip().splitlines()) <= 2
    code, out = _main(["estimate", "--params", "1B", "--compute-s", "2"], capsys)
    assert code != 0 and "--compute-s needs --link" in out
