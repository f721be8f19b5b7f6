"""An ordinary Hugging Face Trainer script: `--deepspeed CONFIG` goes to TrainingArguments(deepspeed=...).

    zerorun --nproc 2 --as-deepspeed tests/data/hf_deepspeed/trainer_script.py --deepspeed ds.json --out OUT
    zerorun --nproc 2 tests/data/hf_deepspeed/trainer_script.py --out OUT            # plain Trainer (DDP)

Nothing here knows about zerorun. A tiny GPT-2 built from a config (no download) learns
arithmetic progressions; rank 0 writes the logged losses, the final eval loss and the saved
model's directory to OUT/result.json. `--eval-only` runs `trainer.evaluate()` alone.
"""

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB, SEQ = 61, 12


class Progressions(torch.utils.data.Dataset):
    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(1, VOCAB, (count, 1), generator=generator)
        stride = torch.randint(1, 4, (count, 1), generator=generator)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--eval-only", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)
    options = parser.parse_args()

    torch.set_num_threads(1)
    args = TrainingArguments(
        output_dir=options.out, deepspeed=options.deepspeed, use_cpu=True, ddp_backend="gloo",
        report_to="none", disable_tqdm=True, per_device_train_batch_size=2, per_device_eval_batch_size=3,
        gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.0, max_grad_norm=0.3,
        warmup_steps=2, lr_scheduler_type="linear", max_steps=options.steps, logging_steps=1, seed=7,
        dataloader_num_workers=0, save_strategy="no",
    )
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=24, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(1234)
    model = GPT2LMHeadModel(config)
    trainer = Trainer(model=model, args=args, train_dataset=Progressions(32, seed=1),
                      eval_dataset=Progressions(12, seed=2))
    if not options.eval_only:
        trainer.train()
    metrics = trainer.evaluate()
    final = os.path.join(options.out, "final")
    if not options.eval_only:
        trainer.save_model(final)
    if args.process_index == 0:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        result = {"loss": losses, "eval_loss": metrics["eval_loss"], "final": final,
                  "wrapped": type(trainer.model_wrapped).__module__ + "." + type(trainer.model_wrapped).__name__}
        with open(os.path.join(options.out, "result.json"), "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main()
