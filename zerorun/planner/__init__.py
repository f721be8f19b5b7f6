"""The memory planner behind ``zerorun estimate`` (docs/estimate.md has every formula).

Pure core: quantities.py (parse "7B", "80GB"), architecture.py + presets.py + hf_config.py (what
the model is), activations.py and memory.py (bytes per GPU / host / NVMe), plan.py (every stage x
offload option, verdict, recommendation), render.py (Rich table, JSON). Effectful edges:
counting.py (build a model on the meta device) and measure.py (run real steps to compare).

    from zerorun.planner.memory import Job, Training, estimate
    from zerorun.planner.presets import preset_spec
    estimate(preset_spec("llama-7b"), Job(gpus_per_node=8), Training(stage=3)).gpu_total
"""
