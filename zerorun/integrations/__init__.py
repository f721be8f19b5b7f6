"""Third-party training loops on a zerorun engine (docs/integrations.md).

    zerorun.integrations.hf          ZerorunTrainer, ZerorunTrainingArguments (transformers Trainer)
    zerorun.integrations.accelerate  prepare(accelerator, model, optimizer, config) for Accelerate loops
    zerorun.integrations.hf_auto     "auto" config values filled from TrainingArguments (pure)

Import the submodule you need: each imports its framework (transformers, accelerate) only
when it is imported itself, so ``import zerorun`` never pulls them in.
"""
