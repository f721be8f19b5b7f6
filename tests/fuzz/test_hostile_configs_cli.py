"""pytest tests/fuzz/test_hostile_configs_cli.py — hostile configs through the launcher (issue 31 items 9, 13, 17, 20).

Each case is a config file (or an environment variable) that some worker would refuse, or
silently misread, after start. Through the CLI's ``main`` in-process (``--nproc 2``, a script that
would leave a marker file if it ever ran), every one must be refused before any worker starts:
exit 2, one ``zerorun: error:`` line (and at most a hint), no traceback, and no line that
contradicts itself ("must be an integer, got an integer"). One case runs the real subprocess too,
so the optimizer check in the launcher's child Python is covered.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401  (the launcher then checks optimizer values in-process, not in a child Python)

from zerorun.cli.main import main

REPO = Path(__file__).resolve().parents[2]
NUL = "\x00"

# (name, file name, text): YAML unless the name ends in .json.
CASES: list[tuple[str, str, str | bytes]] = [
    # numbers out of range
    ("stage-5", "c.yaml", "zero: {stage: 5}"),
    ("stage-negative", "c.yaml", "zero: {stage: -1}"),
    ("stage-23-digits", "c.yaml", "zero: {stage: 10000000000000000000000}"),
    ("stage-1e30", "c.json", '{"zero": {"stage": 1e30}}'),
    ("stage-string-1e30", "c.yaml", "zero: {stage: '1e30'}"),
    ("bucket-zero", "c.yaml", "zero: {reduce_bucket_size: 0}"),
    ("bucket-negative", "c.yaml", "zero: {reduce_bucket_size: -1}"),
    ("allgather-1e30", "c.json", '{"zero": {"allgather_bucket_size": 1e30}}'),
    ("bucket-2-to-41", "c.yaml", f"zero: {{prefetch_bucket_size: {2**41}}}"),
    ("bucket-nan", "c.yaml", "zero: {update_bucket_size: .nan}"),
    ("clipping-negative", "c.yaml", "gradient_clipping: -1"),
    ("clipping-inf", "c.yaml", "gradient_clipping: .inf"),
    ("clipping-nan", "c.yaml", "gradient_clipping: .nan"),
    ("interval-1e-9", "c.yaml", "telemetry: {interval_s: 1.0e-9}"),
    ("interval-zero", "c.yaml", "telemetry: {interval_s: 0}"),
    ("hang-timeout-1e300", "c.yaml", "telemetry: {hang_timeout_s: 1.0e+300}"),
    ("hang-timeout-negative", "c.yaml", "telemetry: {hang_timeout_s: -5}"),
    ("startup-timeout-1e12", "c.yaml", "telemetry: {startup_timeout_s: 1.0e+12}"),
    ("hang-after-zero", "c.yaml", "telemetry: {hang_after_s: 0}"),
    ("keep-last-zero", "c.yaml", "checkpoint: {dir: ck, keep_last: 0}"),
    ("keep-last-31-digits", "c.yaml", f"checkpoint: {{dir: ck, keep_last: {10**30}}}"),
    ("interval-steps-negative", "c.yaml", "checkpoint: {dir: ck, interval_steps: -1}"),
    ("seed-negative", "c.yaml", "seed: -1"),
    ("seed-2-to-40", "c.yaml", f"seed: {2**40}"),
    ("scale-power-64", "c.yaml", "precision: {dtype: fp16, initial_scale_power: 64}"),
    ("min-loss-scale-zero", "c.yaml", "precision: {dtype: fp16, min_loss_scale: 0}"),
    ("buffer-count-zero", "c.yaml", "zero: {stage: 2, offload_optimizer: {device: cpu, buffer_count: 0}}"),
    ("buffer-size-1e30", "c.json", '{"zero": {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_size": 1e30}}}'),
    ("micro-batch-zero", "c.yaml", "batch: {micro_batch_size: 0}"),
    ("train-batch-26-digits", "c.yaml", f"batch: {{train_batch_size: {10**25}}}"),
    # wrong types
    ("stage-word", "c.yaml", "zero: {stage: two}"),
    ("overlap-comm-string", "c.yaml", "zero: {overlap_comm: 'yes please'}"),
    ("zero-a-list", "c.yaml", "zero: [1, 2]"),
    ("telemetry-a-number", "c.yaml", "telemetry: 3"),
    ("dtype-fp8", "c.yaml", "precision: {dtype: fp8}"),
    ("offload-to-disk", "c.yaml", "zero: {stage: 2, offload_optimizer: {device: disk}}"),
    ("checkpoint-dir-a-number", "c.yaml", "checkpoint: {dir: 5}"),
    ("modules-a-string", "c.yaml", "activation_checkpointing: {enabled: true, modules: Block}"),
    ("optimizer-a-string", "c.yaml", "optimizer: AdamW"),
    ("lr-abc", "c.yaml", "optimizer: {type: AdamW, params: {lr: abc}}"),
    ("lr-negative", "c.yaml", "optimizer: {type: AdamW, params: {lr: -1.0}}"),
    ("betas-out-of-range", "c.yaml", "optimizer: {type: AdamW, params: {betas: [2, 3]}}"),
    ("eps-negative", "c.yaml", "optimizer: {type: Adam, params: {eps: -1.0}}"),
    ("momentum-word", "c.yaml", "optimizer: {type: SGD, params: {lr: 0.1, momentum: high}}"),
    ("optimizer-typo", "c.yaml", "optimizer: {type: Adamm}"),
    ("scheduler-unknown", "c.yaml", "scheduler: {type: Nope}"),
    ("scheduler-bad-argument", "c.yaml", "scheduler: {type: StepLR, params: {step_size: 2, gama: 0.5}}"),
    ("ds-lr-abc", "c.json", '{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": "abc"}}}'),
    ("ds-stage-9", "c.json", '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 9}}'),
    ("ds-allgather-1e30", "c.json", '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "allgather_bucket_size": 1e30}}'),
    ("mixed-formats", "c.json", '{"train_micro_batch_size_per_gpu": 2, "zero": {"stage": 2}}'),
    # NUL and unicode
    ("nvme-path-nul", "c.json", json.dumps({"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": f"/tmp/a{NUL}b"}}})),
    ("checkpoint-dir-nul", "c.json", json.dumps({"checkpoint": {"dir": f"ck{NUL}x"}})),
    ("optimizer-type-nul", "c.json", json.dumps({"optimizer": {"type": f"Adam{NUL}W"}})),
    ("module-name-nul", "c.json", json.dumps({"activation_checkpointing": {"modules": [f"Block{NUL}"]}})),
    ("stage-full-width-digit", "c.yaml", "zero: {stage: '２'}"),
    ("key-full-width-letter", "c.yaml", "ｚero: {stage: 2}"),
    ("dtype-unicode-digits", "c.yaml", "precision: {dtype: bf１６}"),
    ("right-to-left-override-key", "c.yaml", "zero: {\u202estage: 2}"),
    # structure: nesting, duplicates, size, emptiness, bytes
    ("deep-yaml", "c.yaml", "zero: " + "[" * 200 + "]" * 200),
    ("deep-json", "c.json", '{"zero": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ("alias-bomb", "c.yaml", "".join(
        f"{n}: &{n} [{', '.join([f'*{p}'] * 10) if p else ', '.join(['lol'] * 10)}]\n"
        for p, n in zip([None, "a", "b", "c", "d", "e", "f", "g"], "abcdefgh", strict=True))),
    ("duplicate-top-key", "c.yaml", "zero: {stage: 1}\nzero: {stage: 3}\n"),
    ("duplicate-nested-key", "c.yaml", "zero:\n  stage: 1\n  stage: 3\n"),
    ("duplicate-json-key", "c.json", '{"zero": {"stage": 1, "stage": 3}}'),
    ("huge-file", "c.yaml", "# " + "x" * (2 << 20) + "\nzero: {stage: 1}\n"),
    ("top-level-list", "c.yaml", "- zero\n- stage\n"),
    ("top-level-number", "c.json", "3"),
    ("not-utf8", "c.yaml", b"zero: {stage: \xff\xfe}\n"),
    ("not-yaml", "c.yaml", "zero: {stage: [}\n"),
    ("wrong-suffix", "c.txt", "zero: {stage: 1}\n"),
]
ENVIRONMENTS = [  # (name, variables, what the line names)
    ("host-channel-yes", {"ZERORUN_HOST_CHANNEL": "yes"}, "ZERORUN_HOST_CHANNEL is 'yes'"),
    ("env-stage-word", {"ZERORUN_ZERO__STAGE": "abc"}, "zero.stage = 'abc'"),
    ("env-unknown-key", {"ZERORUN_ZERO__STAGEE": "2"}, "ZERORUN_ZERO__STAGEE"),
]
# The words of a requirement repeated as what was found: the self-contradicting messages of item 13.
CONTRADICTION = re.compile(r"must be (an integer|a number|a string)(?: or null)?, got \1\b(?! (of|beyond|standing))")


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("open('worker_started', 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith(("ZERORUN_", "SLURM_"))]:
        monkeypatch.delenv(name)
    return tmp_path


def refused_before_start(args, workdir, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["--nproc", "2", "--no-dashboard", *args, "train.py"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = [line for line in err.splitlines() if not line.startswith("zerorun: hint: ")]
    assert len(lines) == 1 and lines[0].startswith("zerorun: error: "), err
    assert "Traceback" not in err and not CONTRADICTION.search(err), err
    assert not (workdir / "worker_started").exists() and not (workdir / "zerorun-runs").exists()
    return lines[0]


@pytest.mark.parametrize("text", ["", "# zero: {stage: 3}\n"], ids=["empty", "only-comments"])
def test_an_empty_config_file_is_said_once(workdir, capsys, text):
    """Issue 31 item 20: the defaults apply (an earlier design), but never silently."""
    (workdir / "c.yaml").write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["--dry-run", "--nproc", "2", "--config", "c.yaml", "train.py"])
    err = capsys.readouterr().err
    assert exit_info.value.code in (0, None), err
    assert err.count("c.yaml' is empty: the defaults apply") == 1, err


def test_there_are_at_least_50_cases():
    assert len(CASES) + len(ENVIRONMENTS) >= 50


@pytest.mark.parametrize("name, file, text", CASES, ids=[case[0] for case in CASES])
def test_a_hostile_config_is_one_line_before_any_worker_starts(workdir, capsys, name, file, text):
    path = workdir / file
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    line = refused_before_start(["--config", file], workdir, capsys)
    if name == "stage-23-digits":
        assert line.endswith("must be an integer, got an integer of 23 digits (beyond 64 bits)"), line
    if name == "clipping-nan":
        assert line.endswith("must be a number, got NaN (not a number)"), line
    if name.startswith("duplicate"):
        assert "appears twice" in line, line


@pytest.mark.parametrize("name, environ, named", ENVIRONMENTS, ids=[case[0] for case in ENVIRONMENTS])
def test_a_hostile_environment_is_one_line_before_any_worker_starts(workdir, capsys, monkeypatch, name, environ, named):
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    line = refused_before_start([], workdir, capsys)
    assert named in line, line


@pytest.mark.slow
def test_the_real_launcher_checks_optimizer_names_and_the_workers_their_values(workdir):
    """Note [no torch in the launcher] (zerorun/config/torch_signatures.py): a misspelt keyword
    is refused before start without torch; a value torch refuses is refused by the workers'
    initialize, before the first step, naming the key."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERORUN_", "SLURM_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")

    def launch(config: str):
        (workdir / "c.yaml").write_text(config)
        return subprocess.run([sys.executable, "-m", "zerorun", "--nproc", "2", "--no-dashboard", "--config", "c.yaml",
                               "train.py"], cwd=workdir, env=env, capture_output=True, text=True, timeout=300)

    done = launch("optimizer: {type: AdamW, params: {lrr: 0.1}}\n")
    assert done.returncode == 2, done.stderr
    assert "optimizer.params.lrr: torch.optim.AdamW takes no such argument (did you mean 'lr'?)" in done.stderr
    assert not (workdir / "worker_started").exists()
    (workdir / "train.py").write_text("import torch, zerorun\n"
                                      "open('worker_started', 'w').close()\n"
                                      "zerorun.initialize(torch.nn.Linear(2, 2))\n"
                                      "open('first_step', 'w').close()\n")
    done = launch("optimizer: {type: AdamW, params: {lr: -1.0}}\n")
    assert done.returncode != 0
    assert "optimizer.params = {'lr': -1.0}: torch.optim.AdamW refuses them: Invalid learning rate: -1.0" in done.stdout
    assert (workdir / "worker_started").exists() and not (workdir / "first_step").exists()
