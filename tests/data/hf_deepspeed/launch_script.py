"""An ordinary Accelerate training loop that leaves the distributed setup to the launcher.

    accelerate launch --use_deepspeed --zero_stage 3 --num_processes 2 tests/data/hf_deepspeed/launch_script.py --out OUT
    zerorun --accelerate-config accelerate.yaml tests/data/hf_deepspeed/launch_script.py --out OUT
    accelerate launch --cpu --num_processes 2 tests/data/hf_deepspeed/launch_script.py --out OUT  # DDP

Nothing here knows about zerorun or DeepSpeed: ``Accelerator()`` reads what the launcher set
(``ACCELERATE_USE_DEEPSPEED``, the ZeRO stage, accumulation, clipping). A tiny GPT-2 from a
config learns arithmetic progressions with AdamW, a linear warm-up/decay schedule, accumulation 2
and clipping at 0.3; rank 0 writes every micro-batch's loss to OUT/result.json.
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

VOCAB, SEQ = 61, 12


def progressions(count, seed):
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(1, VOCAB, (count, 1), generator=generator)
    stride = torch.randint(1, 4, (count, 1), generator=generator)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    options = parser.parse_args()

    torch.set_num_threads(1)
    # On a machine without GPUs Accelerate needs the gloo backend named (its default is NCCL),
    # under real DeepSpeed as under zerorun; with GPUs this line can go.
    accelerator = Accelerator(gradient_accumulation_steps=2, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=24, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(1234)
    model = GPT2LMHeadModel(config)
    ids = progressions(32, seed=1)
    loader = torch.utils.data.DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=8)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses = []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.3)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.makedirs(options.out, exist_ok=True)
        with open(os.path.join(options.out, "result.json"), "w") as handle:
            json.dump({"loss": losses, "distributed_type": str(accelerator.distributed_type),
                       "wrapped": type(model).__module__ + "." + type(model).__name__}, handle)
    accelerator.end_training()


if __name__ == "__main__":
    main()
