"""Imported by tests/integrations/*: a tiny GPT-2, its data, and a 2-rank gloo world for Trainer
and Accelerate.

Trainer and Accelerate read the distributed setup from torchrun's variables (RANK, WORLD_SIZE,
LOCAL_RANK, ...); each worker sets them, then joins the group itself with a ``file://`` init
method (no ports to race for). Accelerate's CPU state finds the group initialised and uses it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from gloo_world import start_processes

WORLD = 2
VOCAB = 61
SEQ = 12


def spawn(worker, out_dir: Path, *extra) -> dict[int, dict]:
    start_processes(worker, (str(out_dir), *extra), WORLD)
    return {rank: json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)}


def join_world(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks share two cores
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(WORLD),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",  # unused: the group exists before Accelerate looks
        "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "ACCELERATE_USE_CPU": "true",
        "TOKENIZERS_PARALLELISM": "false",
    })
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=WORLD)


def write_result(out_dir: str, rank: int, result: dict) -> None:
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def build_model(seed: int = 1234):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=24, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def sequences(count: int, seed: int) -> torch.Tensor:
    """Arithmetic progressions mod VOCAB with random starts and strides: learnable."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(1, VOCAB, (count, 1), generator=generator)
    stride = torch.randint(1, 4, (count, 1), generator=generator)
    return (start + stride * torch.arange(SEQ)) % VOCAB


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int):
        self.ids = sequences(count, seed)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}
