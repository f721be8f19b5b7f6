"""A TRL training script as users write them: SFT, DPO or reward modelling, `--deepspeed CONFIG`
into the trainer's config, optionally LoRA.

    zerorun --nproc 2 --as-deepspeed tests/data/trl/trl_script.py --trainer dpo --model M --deepspeed ds.json --out OUT
    torchrun --nproc_per_node 2 tests/data/trl/trl_script.py --trainer dpo --model M --out OUT    # DDP
    python tests/data/trl/trl_script.py --build DIR            # tiny Llama and GPT-2 under DIR, nothing downloaded

Nothing here knows about zerorun. TRL's defaults stand (gradient checkpointing on) but for fp32
(TRL turns bf16 on by default; fp32 makes a 1e-4 comparison meaningful). Rank 0 writes the logged
losses to OUT/result.json, and for DPO at ZeRO-3 what its reference model holds on this rank.
"""

import argparse
import json
import os

import torch

WORDS = ["add", "and", "is", "the", "sum", "of", "Human:", "Assistant:"] + [str(n) for n in range(20)]
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]


def build(root):
    """A word-level tokenizer and a tiny Llama and GPT-2 built from configs (seed 0), each saved
    to its own directory as from_pretrained reads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", model_max_length=64)
    ids = {"vocab_size": len(vocab), "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3}
    configs = {
        "llama": (LlamaForCausalLM, LlamaConfig(hidden_size=16, intermediate_size=40, num_hidden_layers=2,
                                                num_attention_heads=2, num_key_value_heads=1,
                                                max_position_embeddings=64, tie_word_embeddings=False, **ids)),
        "gpt2": (GPT2LMHeadModel, GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                                             embd_pdrop=0.0, attn_pdrop=0.0, **ids)),
    }
    for name, (model_class, config) in configs.items():
        torch.manual_seed(0)
        model_class(config).save_pretrained(os.path.join(root, name))
        tokenizer.save_pretrained(os.path.join(root, name))


def rows(count, seed):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        a, b = (int(v) for v in torch.randint(0, 10, (2,), generator=generator))
        wrong = (a + b + 1 + int(torch.randint(0, 3, (1,), generator=generator))) % 20
        prompt = f"Human: add {a} and {b} Assistant:"
        out.append({"prompt": prompt, "chosen": f" {(a + b) % 20}", "rejected": f" {wrong}",
                    "text": f"{prompt} {(a + b) % 20}"})
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default=None)
    parser.add_argument("--trainer", choices=["sft", "dpo", "reward"], default="sft")
    parser.add_argument("--model", default=None)
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed-style launchers append it
    options = parser.parse_args()
    if options.build:
        build(options.build)
        return

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, set_seed

    torch.set_num_threads(1)
    set_seed(7)  # before the models: the reward model's new score head is drawn from it
    common = dict(output_dir=options.out, deepspeed=options.deepspeed, use_cpu=True, ddp_backend="gloo", bf16=False,
                  report_to="none", disable_tqdm=True, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  learning_rate=1e-2 if options.lora else 3e-3, max_grad_norm=0.3, max_steps=options.steps,
                  logging_steps=1, seed=7, save_strategy="no", dataloader_num_workers=0)
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    peft_config = None
    if options.lora:
        from peft import LoraConfig

        targets = ["c_attn"] if "gpt2" in options.model else ["q_proj", "v_proj"]
        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                                 task_type="SEQ_CLS" if options.trainer == "reward" else "CAUSAL_LM")
    data = Dataset.from_list(rows(32, seed=1))
    if options.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**common)
        trainer = SFTTrainer(model=options.model, args=args, train_dataset=data.select_columns(["text"]),
                             processing_class=tokenizer, peft_config=peft_config)
    elif options.trainer == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**common, beta=0.5)
        model = AutoModelForCausalLM.from_pretrained(options.model)
        trainer = DPOTrainer(model=model, args=args, train_dataset=data.select_columns(["prompt", "chosen", "rejected"]),
                             processing_class=tokenizer, peft_config=peft_config)
    else:
        from trl import RewardConfig, RewardTrainer

        args = RewardConfig(**common)
        model = AutoModelForSequenceClassification.from_pretrained(options.model, num_labels=1)
        model.config.pad_token_id = tokenizer.pad_token_id
        pairs = data.map(lambda row: {"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]})
        trainer = RewardTrainer(model=model, args=args, train_dataset=pairs.select_columns(["chosen", "rejected"]),
                                processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    result = {"loss": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
              "gradient_checkpointing": bool(args.gradient_checkpointing),
              # whether the model itself recomputes (PEFT's wrapper passes the attribute through)
              "model_checkpointing": bool(getattr(trainer.model, "is_activation_checkpointing", False)),
              "wrapped": type(trainer.model_wrapped).__module__ + "." + type(trainer.model_wrapped).__name__}
    reference = getattr(trainer, "ref_model", None)
    if reference is not None and hasattr(reference, "memory_breakdown"):
        # What the reference model's parameters occupy on this rank against their whole size.
        whole = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in reference.module.parameters())
        result["reference"] = {"held": reference.memory_breakdown()["parameters"], "whole": whole,
                               "wrapped": type(reference).__module__ + "." + type(reference).__name__}
    if args.process_index == 0:
        with open(os.path.join(options.out, "result.json"), "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main()
