"""pytest tests/e2e/test_consolidate_errors.py — ``zerorun consolidate`` on bad outputs and inputs.

A checkpoint is saved at world size 1 in this process; the CLI runs as a subprocess. Each bad
case must be one ``zerorun: error:`` line, a non-zero exit, no traceback, and nothing left
behind: an output that is a directory, an output inside the checkpoint (it would replace
``latest`` or a shard), a ``.partial`` input, a full disk (simulated by a 1000-byte file-size
limit on the subprocess, so writes fail with EFBIG as they would with ENOSPC).
"""

from __future__ import annotations

import sys

import pytest
from test_consolidate import cli, saved_dropnet

pytestmark = pytest.mark.slow


def _one_error_line(done, *fragments):
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("zerorun: error:")]
    assert len(errors) == 1, done.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_an_output_that_is_a_directory(tmp_path):
    ckpt, _ = saved_dropnet(tmp_path)
    (tmp_path / "out").mkdir()
    _one_error_line(cli("consolidate", str(ckpt), str(tmp_path / "out")), "is a directory; without --hf-config or --like")
    assert not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize("inside", ["latest", "global_step2/rank0.safetensors", "hf"])
def test_an_output_inside_the_checkpoint_is_refused(tmp_path, inside):
    ckpt, _ = saved_dropnet(tmp_path)
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    args = ["consolidate", str(ckpt), str(ckpt / inside)]
    if inside == "hf":
        (tmp_path / "config.json").write_text("{}")
        args += ["--hf-config", str(tmp_path / "config.json")]
    _one_error_line(cli(*args), "is inside the checkpoint directory")
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before


def test_a_partial_input_says_so(tmp_path):
    ckpt, _ = saved_dropnet(tmp_path)
    (ckpt / "global_step9.partial").mkdir()
    _one_error_line(cli("consolidate", str(ckpt / "global_step9.partial"), str(tmp_path / "m.safetensors")),
                    "is a save that did not finish (a .partial folder)")


LIMITED = r'''
import resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
import signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG instead
from zerorun.cli.main import main
main(sys.argv[1:])
'''


@pytest.mark.parametrize("layout", ["file", "hf"])
def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, layout):
    import os
    import subprocess

    from test_consolidate import REPO

    ckpt, _ = saved_dropnet(tmp_path)
    (tmp_path / "limited.py").write_text(LIMITED)
    (tmp_path / "config.json").write_text("{}")
    out = tmp_path / ("model.safetensors" if layout == "file" else "hf")
    args = [str(ckpt), str(out)] + (["--hf-config", str(tmp_path / "config.json")] if layout == "hf" else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZERORUN_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, str(tmp_path / "limited.py"), "consolidate", *args], env=env,
                          capture_output=True, text=True, timeout=120)
    _one_error_line(done, "failed after", "File too large")
    # Issue 31 item 14: it used to say "the previous checkpoint is intact", of a consolidation.
    assert "previous checkpoint" not in done.stderr and "the checkpoint was only read and is unchanged" in done.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


@pytest.mark.parametrize("layout", ["file", "hf"])
def test_an_existing_output_is_never_overwritten(tmp_path, layout):
    """Issue 31 item 20: consolidate replaced an existing model file without a word."""
    ckpt, _ = saved_dropnet(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    out = tmp_path / ("model.safetensors" if layout == "file" else "hf")
    target = out if layout == "file" else out / "model.safetensors"
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(b"someone's model")
    args = [str(ckpt), str(out)] + (["--hf-config", str(tmp_path / "config.json")] if layout == "hf" else [])
    _one_error_line(cli("consolidate", *args), "exists; consolidate does not overwrite it")
    assert target.read_bytes() == b"someone's model"

