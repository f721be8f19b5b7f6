"""An ordinary Accelerate training loop; `--zero-stage N` adds a DeepSpeedPlugin, as such scripts do.

    zerorun --nproc 2 --as-deepspeed tests/data/hf_deepspeed/accelerate_script.py --zero-stage 3 --out OUT
    zerorun --nproc 2 tests/data/hf_deepspeed/accelerate_script.py --out OUT          # plain Accelerate (DDP)

Nothing here knows about zerorun. A tiny GPT-2 from a config learns arithmetic progressions with
AdamW, a linear warm-up/decay schedule, accumulation 2 and clipping at 0.3; rank 0 writes every
micro-batch's loss and the saved model's directory to OUT/result.json.
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator, DeepSpeedPlugin
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
    parser.add_argument("--zero-stage", type=int, default=None)
    parser.add_argument("--out", required=True)
    options = parser.parse_args()

    torch.set_num_threads(1)
    plugin = None
    if options.zero_stage is not None:
        plugin = DeepSpeedPlugin(zero_stage=options.zero_stage, gradient_accumulation_steps=2,
                                 gradient_clipping=0.3, zero3_save_16bit_model=True)
    # A CPU-only machine: Accelerate runs DDP there only with cpu=True, and DeepSpeed only with
    # cpu=False and an explicit gloo backend (its NCCL default needs GPUs).
    accelerator = Accelerator(cpu=plugin is None, gradient_accumulation_steps=2, deepspeed_plugin=plugin,
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
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
    final = os.path.join(options.out, "final")
    state = accelerator.get_state_dict(model)
    accelerator.unwrap_model(model).save_pretrained(final, state_dict=state,
                                                    is_main_process=accelerator.is_main_process)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(os.path.join(options.out, "result.json"), "w") as handle:
            json.dump({"loss": losses, "final": final, "wrapped": type(model).__module__ + "." + type(model).__name__},
                      handle)
    accelerator.end_training()


if __name__ == "__main__":
    main()
