"""pytest tests/e2e/test_estimate_cli.py — ``zerorun estimate`` as users run it.

The seed table and one bad input go through a real subprocess (the installed entry point's
code path: ``python -m zerorun``); the other cases call ``zerorun.cli.main.main(argv)`` in-process,
which is the same dispatcher without the interpreter start-up.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zerorun.cli.main import main

# The ZeRO paper's 7B / 8 GPU table, but stage 3 keeps one fp32 copy per shard (Note [fp32 shard]): 14Ψ/N.
SEED = {0: 112.0, 1: 38.5, 2: 26.25, 3: 12.25}


def run_cli(args, capsys) -> tuple[int, str, str]:
    try:
        main(["estimate", *args])
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(stdout: str) -> dict[tuple[str, str], list[str]]:
    """(stage, offload) -> cells of a Rich table row."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) > 5 and cells[0].isdigit():
            rows[(cells[0], cells[1].rstrip(" *"))] = cells
    return rows


def test_seed_table_in_a_real_subprocess():
    done = subprocess.run([sys.executable, "-m", "zerorun", "estimate", "--params", "7B", "--gpus", "8"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "GB (decimal, 1 GB = 10^9 bytes)" in done.stdout
    header = next(line for line in done.stdout.splitlines() if "model state" in line)
    model_state_column = [c.strip() for c in header.split("┃")[1:-1]].index("model state")
    rows = table_rows(done.stdout)
    for stage, gb in SEED.items():
        assert rows[(str(stage), "none")][model_state_column] == f"{gb:.2f}"


def test_json_output_has_the_seed_numbers(capsys):
    code, out, _ = run_cli(["--params", "7B", "--gpus", "8", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    by_option = {(o["stage"], o["offload"]): o for o in data["options"]}
    for stage, gb in SEED.items():
        option = by_option[(stage, "none")]
        assert option["gb_per_gpu"]["model_state"] == gb
        assert option["bytes_per_gpu"]["model_state"] == int(gb * 1e9)
    assert data["job"]["world_size"] == 8 and data["precision"] == "bf16"


def test_hostfile_sets_the_world(tmp_path, capsys):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=4\nnode-b slots=4  # second node\n")
    code, out, _ = run_cli(["--params", "7B", "--hostfile", str(hostfile), "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["job"] == {"gpus_per_node": 4, "nodes": 2, "world_size": 8}
    stage3 = next(o for o in data["options"] if (o["stage"], o["offload"]) == (3, "cpu-optimizer"))
    # host memory is per node: 4 ranks' optimizer shards (12 bytes x 7B / 8 = 10.5 GB each), each
    # with one unit's fp32 gradient chunk staged at a time (well under 0.1 GB), plus what the
    # pinned arena holds beyond the 3.5 GB of fp32 masters per rank (Note [pinned arena])
    slack = stage3["gb_per_gpu"]["pinned_slack_per_node"]
    assert 0 < slack < 4 * 0.35
    assert stage3["gb_per_gpu"]["host_per_node"] == pytest.approx(4 * 10.5 + slack, rel=0.01)


def test_config_file_sets_stage_precision_and_offload(tmp_path, capsys):
    config = tmp_path / "zero.yaml"
    config.write_text("zero:\n  stage: 2\n  offload_optimizer:\n    device: cpu\nprecision:\n  dtype: fp16\n")
    code, out, _ = run_cli(["--params", "1.3B", "--gpus", "4", "--config", str(config), "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["requested"] == {"stage": 2, "offload": "cpu-optimizer"}
    assert data["precision"] == "fp16"
    # a flag beats the file
    code, out, _ = run_cli(["--params", "1.3B", "--config", str(config), "--stage", "3", "--json"], capsys)
    assert json.loads(out)["requested"] == {"stage": 3, "offload": "cpu-optimizer"}


def test_preset_with_activations_verdict_and_recommendation(capsys):
    args = ["--preset", "llama-7b", "--gpus", "8", "--micro-batch", "1", "--seq-len", "2048",
            "--activation-checkpointing", "--gpu-memory", "40GB", "--host-memory", "1TB"]
    code, out, _ = run_cli([*args, "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert all(o["bytes_per_gpu"]["activations"] > 0 for o in data["options"])
    assert data["recommended"] is not None
    chosen = next(o for o in data["options"]
                  if (o["stage"], o["offload"]) == (data["recommended"]["stage"], data["recommended"]["offload"]))
    assert chosen["fits"] is True and chosen["bytes_per_gpu"]["gpu_total"] <= 40e9
    code, out, _ = run_cli(args, capsys)
    assert "recommended: stage" in out and "no: GPU" in out


def test_hf_config_source(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12,
                                  "vocab_size": 50257, "n_positions": 1024}))
    code, out, _ = run_cli(["--hf-config", str(config), "--json"], capsys)
    assert code == 0
    assert json.loads(out)["model"]["num_params"] == 124_439_808


BAD_INPUTS = {
    "unknown suffix": ["--params", "7Q"],
    "unknown preset": ["--preset", "gpt5"],
    "negative gpus": ["--params", "7B", "--gpus", "-2"],
    "zero nodes": ["--params", "7B", "--nodes", "0"],
    "two model sources": ["--params", "7B", "--preset", "gpt2"],
    "no model source": ["--gpus", "8"],
    "missing hf config": ["--hf-config", "/nonexistent/config.json"],
    "offload at stage 0": ["--params", "7B", "--stage", "0", "--offload", "nvme"],
    "bad stage": ["--params", "7B", "--stage", "4"],
    "bad precision": ["--params", "7B", "--precision", "fp8"],
    "bad memory unit": ["--params", "7B", "--gpu-memory", "80XB"],
    "half the activation flags": ["--params", "7B", "--seq-len", "128"],
    "measure without a model": ["--params", "7B", "--measure"],
    "bad model target": ["--model", "no_such_module_xyz:build"],
    "missing config": ["--params", "7B", "--config", "/nonexistent.yaml"],
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_non_zero(name, capsys):
    code, out, err = run_cli(BAD_INPUTS[name], capsys)
    assert code != 0
    lines = err.strip().splitlines()
    assert lines and lines[0].startswith("zerorun: error: ")
    assert all(line.startswith("zerorun: ") for line in lines) and len(lines) <= 2
    assert "Traceback" not in err + out


def test_bad_input_in_a_real_subprocess_has_no_traceback():
    done = subprocess.run([sys.executable, "-m", "zerorun", "estimate", "--params", "7Q"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.startswith("zerorun: error: unknown suffix 'q' in parameter count '7Q'")
    assert "Traceback" not in done.stderr
