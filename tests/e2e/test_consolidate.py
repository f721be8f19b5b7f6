"""pytest tests/e2e/test_consolidate.py — ``zerorun consolidate`` and damaged checkpoints.

Checkpoints here are saved at world size 1 in this process (no process group); the CLI runs as
a real subprocess (``python -m zerorun consolidate ...``) whose output is checked:
- a truncated or corrupted shard: one ``zerorun: error:`` line naming the file, a hint line,
  a non-zero exit and no traceback; the engine's load raises CheckpointError naming it too;
- a checkpoint of another model: the error names the first mismatching parameter;
- a tiny Hugging Face GPT-2 trained under stage 3: the consolidated directory loads with
  ``from_pretrained`` (tied weights written once) and equals the engine's full state dict;
- a model file of the example GPT (head tied to the token embedding) holds every name and loads
  with ``load_state_dict(strict=True)``;
- the rank files and the output are standard safetensors files (the safetensors library loads them);
- a 201M-parameter stack of Linear layers: consolidation's peak RSS stays below 0.3x the
  model's fp32 bytes above the process's baseline (Note [bounded consolidation]).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import zerorun
from zerorun.errors import CheckpointError

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))
import checkpoint_harness as h  # noqa: E402


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZERORUN_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "zerorun", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def saved_dropnet(tmp_path: Path, stage: int = 2) -> tuple[Path, dict]:
    model = h.build_dropnet()
    engine = zerorun.initialize(model, h.optimizer_for(model), {"zero": {"stage": stage}})
    case = h.ResumeCase("x", stage)
    h.run_steps(engine, case, 0, range(2))
    engine.save_checkpoint(tmp_path / "ckpt")
    return tmp_path / "ckpt", engine.full_state_dict()


def test_consolidate_writes_the_full_model_as_standard_safetensors(tmp_path):
    from safetensors.torch import load_file

    ckpt, full = saved_dropnet(tmp_path)
    shard = load_file(ckpt / "global_step2" / "rank0.safetensors")  # our streamed file, their reader
    assert any(k.startswith("state.exp_avg/") for k in shard)
    done = cli("consolidate", str(ckpt), str(tmp_path / "model.safetensors"))
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout
    out = load_file(tmp_path / "model.safetensors")
    assert set(out) == set(full)  # head.weight, tied to embed.weight, too (as its own copy)
    for name, value in out.items():
        assert torch.equal(value, full[name]), name
    h.DropNet().load_state_dict(out, strict=True)
    done = cli("consolidate", str(ckpt / "global_step2"), str(tmp_path / "model.pt"), "--format", "torch")
    assert done.returncode == 0, done.stderr
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(state) == set(full)  # the torch format keeps the tied alias too, sharing the tensor
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()
    model = h.DropNet()
    model.load_state_dict(state)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_the_consolidated_example_gpt_loads_back_with_strict_load_state_dict(tmp_path, fmt):
    """The example GPT's head is tied to its token embedding: every name is in the file, and the
    command says how the tied one was written."""
    sys.path.insert(0, str(REPO / "examples"))
    from gpt import GPT, PRESETS

    torch.manual_seed(0)
    model = GPT(PRESETS["nano"])
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), {"zero": {"stage": 3}})
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    full = engine.full_state_dict()
    out = tmp_path / ("model.safetensors" if fmt == "safetensors" else "model.pt")
    done = cli("consolidate", str(tmp_path / "ckpt"), str(out), "--format", fmt)
    assert done.returncode == 0, done.stderr
    assert "tied names all written" in done.stdout and "head.weight = tok_emb.weight" in done.stdout, done.stdout
    if fmt == "safetensors":
        from safetensors.torch import load_file

        state = load_file(out)
    else:
        state = torch.load(out, weights_only=True)
    fresh = GPT(PRESETS["nano"])
    fresh.load_state_dict(state, strict=True)
    assert fresh.head.weight is fresh.tok_emb.weight  # still one Parameter after loading
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, full[name].to(value.dtype)), name


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_shard_is_one_clear_error_line(tmp_path, damage):
    ckpt, _ = saved_dropnet(tmp_path)
    shard = ckpt / "global_step2" / "rank0.safetensors"
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    done = cli("consolidate", str(ckpt), str(tmp_path / "out.safetensors"))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("zerorun: error: ") and lines[1].startswith("zerorun: hint: ")
    assert str(shard) in lines[0]
    assert ("truncated" in lines[0]) if damage == "truncate" else ("checksum" in lines[0])
    assert not (tmp_path / "out.safetensors").exists()
    model = h.build_dropnet()
    engine = zerorun.initialize(model, h.optimizer_for(model), {"zero": {"stage": 1}})
    with pytest.raises(CheckpointError, match="rank0.safetensors"):
        engine.load_checkpoint(ckpt)


def test_a_checkpoint_of_another_model_names_the_first_mismatch(tmp_path):
    ckpt, _ = saved_dropnet(tmp_path)
    model = h.build_dropnet()
    model.inner = nn.Linear(h.WIDTH, h.NARROW + 1)
    model.outer = nn.Linear(h.NARROW + 1, h.WIDTH)
    engine = zerorun.initialize(model, h.optimizer_for(model), {"zero": {"stage": 2}})
    with pytest.raises(CheckpointError, match=r"parameter 'inner.weight' has shape \[8, 15\] in the model but \[7, 15\]"):
        engine.load_checkpoint(ckpt)


def test_hugging_face_directory_loads_with_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=101, n_positions=32, n_embd=48, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.config.save_pretrained(tmp_path / "like")
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                {"zero": {"stage": 3, "param_persistence_threshold": 0}})
    for step in range(2):
        ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(step))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    full = engine.full_state_dict()
    done = cli("consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--like", str(tmp_path / "like"))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied again
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, full[name]), name
    from safetensors import safe_open

    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and f.metadata() == {"format": "pt"}
    done = cli("consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf2"), "--hf-config",
               str(tmp_path / "like" / "config.json"), "--dtype", "bf16")
    assert done.returncode == 0, done.stderr
    half = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf2", dtype=torch.bfloat16)
    assert half.transformer.wte.weight.dtype == torch.bfloat16


# 12 Linear(4096, 4096) without bias: 201,326,592 parameters, 805 MB in fp32; the largest
# tensor is 1/12 of the model, so a streamed consolidation peaks near 0.08x.
LAYERS, WIDTH = 12, 4096
MEASURE = textwrap.dedent("""
    import json, sys
    import psutil
    from zerorun.zero.checkpoint.consolidate import consolidate
    def high_water():  # VmHWM belongs to this address space; ru_maxrss would carry pytest's over exec
        line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    baseline = psutil.Process().memory_info().rss
    done = consolidate(sys.argv[1], sys.argv[2])
    print(json.dumps({"baseline": baseline, "peak": high_water(), "bytes": done["bytes"]}))
""")


@pytest.mark.slow
@pytest.mark.long  # a 201M-parameter checkpoint
def test_consolidating_200m_parameters_stays_within_a_third_of_the_model(tmp_path):
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False, device="meta") for _ in range(LAYERS)])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for index, layer in enumerate(model):
            layer.weight.fill_(float(index)).add_(torch.arange(WIDTH, dtype=torch.float32) * 1e-4)
    params = sum(p.numel() for p in model.parameters())
    assert params >= 200_000_000
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero": {"stage": 1}})
    engine.save_checkpoint(tmp_path / "ckpt", tag="big")
    del engine, model
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZERORUN_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "ckpt"), str(tmp_path / "big.safetensors")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    fp32_bytes = params * 4
    above = figures["peak"] - figures["baseline"]
    print(f"\nconsolidate {params:,} params ({fp32_bytes / 2**20:.0f} MiB fp32): peak RSS "
          f"{above / 2**20:.0f} MiB above baseline = {above / fp32_bytes:.3f}x the model")
    assert figures["bytes"] >= fp32_bytes
    assert above <= 0.3 * fp32_bytes
    from safetensors import safe_open

    with safe_open(tmp_path / "big.safetensors", "pt") as f:
        last = f.get_slice(f"{LAYERS - 1}.weight")[WIDTH - 1 : WIDTH]
        assert torch.equal(last[0], float(LAYERS - 1) + torch.arange(WIDTH, dtype=torch.float32) * 1e-4)
