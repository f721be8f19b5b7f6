"""python scripts/bench_gpu.py [--steps 10] [--warmup 3] [--json results.json]

The GPU benchmark: Hugging Face ``LlamaForCausalLM`` of 1.26B parameters (TinyLlama's shape
without grouped-query attention, untied embeddings), bf16, activation checkpointing the Hugging
Face way (``model.gradient_checkpointing_enable()``), batch 8 x 2048 tokens per rank, the same
fused ``torch.optim.AdamW`` for every system (DeepSpeed's ZeRO-Offload excepted: it steps with
its own CPU Adam). Systems, each in a fresh process: FSDP2 (bf16 params, fp32 sharded master),
DDP (fp32 params, bf16 autocast), zerorun stages 1-3 and stage 2 with the optimizer offloaded to
the CPU, and DeepSpeed ZeRO-2, ZeRO-3 and ZeRO-2 + CPU offload when it is installed. Per system:
median step time, model TFLOPS (6 x parameters x tokens / step time), peak allocated and peak
reserved GPU memory, peak host memory, each also as a ratio against FSDP2 in the same run.

Goals (issue 41): zerorun stage 3 <= 1.0x FSDP2 in step time and peak reserved memory; stage 2 +
offload <= 0.6x DeepSpeed ZeRO-Offload's step time where DeepSpeed runs.

One rank (NCCL on the GPU). ``--dry-run``: the same code on the CPU (gloo, one rank) with a
tiny Llama, 2 steps after 1 warm-up, for every system: it checks the program, not speed.

    python scripts/bench_gpu.py --dry-run --json /tmp/bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_systems import DEEPSPEED, SYSTEMS, RankResult, build_trainer, run_world, time_steps  # noqa: E402
from gpu_report import rows  # noqa: E402

ZERORUN = ("zero1", "zero2", "zero3", "zero2+cpu")
DEFAULT_SYSTEMS = ("fsdp2", "ddp", *ZERORUN, "ds2", "ds3", "ds2+cpu")
# Hugging Face LlamaConfig fields per preset, and tokens per sequence.
PRESETS = {
    # 1,261,529,088 parameters (GUIDE.md section 5's 1.26B).
    "1.2b": ({"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
              "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 2048}, 2048),
    # ~0.1M parameters: the same code on CPU in seconds.
    "tiny": ({"vocab_size": 256, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64}, 32),
}
GOALS = {"zero3": {"step": 1.0, "reserved": 1.0}}
# Imported once by the fork server every system's process is forked from (bench_systems.run_world).
PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama", "zerorun",
           "zerorun.zero.engine", "bench_systems"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1.2b", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"comma list from {','.join(('fsdp2', 'ddp', *ZERORUN, *DEEPSPEED))}")
    parser.add_argument("--dry-run", action="store_true", help="tiny Llama on the CPU, 1 warm-up and 2 steps")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.preset, args.steps, args.warmup, args.micro_batch = "tiny", 2, 1, 2
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    known = {"fsdp2", "ddp", *ZERORUN, *DEEPSPEED} | set(SYSTEMS)
    unknown = [s for s in args.systems if s not in known and not s.startswith("zero")]
    if unknown:
        parser.error(f"unknown system(s) {', '.join(unknown)}")
    if args.steps < 1 or args.warmup < 0 or args.micro_batch < 1:
        parser.error("--steps and --micro-batch must be >= 1, --warmup >= 0")
    return args


def build_llama(preset: str, device):
    """The preset's ``LlamaForCausalLM`` on ``device`` (fp32, seeded), with Hugging Face's own
    activation checkpointing on (non-reentrant, as FSDP2 and zerorun stage 3 need)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields, _ = PRESETS[preset]
    config = LlamaConfig(**fields, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def call_llama(module, tokens, targets):
    """Hugging Face's causal-LM loss (it shifts the labels itself)."""
    return module(input_ids=tokens, labels=targets).loss


def trainer_for(system: str, model, lr: float = 1e-4):
    """``system``'s trainer around ``model``: bf16, the same fused AdamW, one FSDP2 unit per decoder layer."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return build_trainer(system, model, lr=lr, precision="bf16", block_class=LlamaDecoderLayer,
                         call=call_llama, fused=True)


def rank_main(rank: int, world: int, system: str, options: dict, init_file: str) -> RankResult:
    import torch
    import torch.distributed as dist

    use_cuda = options["device"] == "cuda"
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    model = build_llama(options["preset"], device)
    params = sum(p.numel() for p in model.parameters())
    trainer = trainer_for(system, model)
    _, seq_len = PRESETS[options["preset"]]
    vocab = model.config.vocab_size

    def batches(step: int):
        generator = torch.Generator().manual_seed(step * 100 + rank)
        tokens = torch.randint(0, vocab, (options["micro_batch"], seq_len), generator=generator).to(device)
        return tokens, tokens

    synchronize = torch.cuda.synchronize if use_cuda else (lambda: None)
    if use_cuda:
        torch.cuda.reset_peak_memory_stats()
    result = time_steps(trainer, batches, options["warmup"], options["steps"], synchronize)
    if use_cuda:
        result.gpu_peak_bytes = torch.cuda.max_memory_allocated()
        result.gpu_reserved_bytes = torch.cuda.max_memory_reserved()
    result.extra = {"params": params, "tokens_per_step": options["micro_batch"] * seq_len * world}
    return result


def deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def render(found: dict) -> str:
    """The benchmark's Markdown table (also gpu_report.py's bench rows)."""
    lines = ["| system | status | step s | x FSDP2 | TFLOPS | GPU alloc GiB | x | GPU reserved GiB | x | host GiB | x |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def figure(value, digits):
        return "-" if value is None else f"{value:.{digits}f}"

    for row in rows(found["results"]):
        if row.get("status") != "ok":
            lines.append(f"| {row['system']} | {row.get('status')}: {row.get('error', '')} |" + " - |" * 9)
            continue
        lines.append("| " + " | ".join([
            row["system"], "ok", figure(row["step_s"], 3), figure(row["step_s_x"], 2), f"{row['tflops']:.3g}",
            figure(row["gpu_peak_gib"], 2), figure(row["gpu_peak_gib_x"], 2),
            figure(row["gpu_reserved_gib"], 2), figure(row["gpu_reserved_gib_x"], 2),
            figure(row["host_peak_gib"], 2), figure(row["host_peak_gib_x"], 2)]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if device == "cpu" and not args.dry_run:
        print("bench_gpu.py: no CUDA device here; --dry-run runs the same code on a tiny model", file=sys.stderr)
        return 2
    options = {"preset": args.preset, "steps": args.steps, "warmup": args.warmup, "device": device,
               "micro_batch": args.micro_batch}
    results = []
    with tempfile.TemporaryDirectory(prefix="zerorun-bench-gpu-") as workdir:
        for system in args.systems:
            if system in DEEPSPEED and not deepspeed_installed():
                results.append({"system": system, "status": "not installed", "error": "DeepSpeed is not installed"})
                continue
            print(f"  {system} ...", end=" ", flush=True)
            result = run_world(rank_main, 1, system, options, Path(workdir), preload=PRELOAD)
            if result.error:
                print(f"failed: {result.error}", flush=True)
                results.append({"system": system, "status": "failed", "error": result.error})
                continue
            extra = json.loads((Path(workdir) / system / "rank0.json").read_text())["extra"]
            print(f"{result.step_s:.3f} s/step", flush=True)
            results.append({**dataclasses.asdict(result), **extra, "status": "ok",
                            "host_peak_gib": result.training_peak_rss_mib / 1024 if result.training_peak_rss_mib else None,
                            "gpu_peak_gib": result.gpu_peak_gib or None,
                            "gpu_reserved_gib": result.gpu_reserved_gib or None})
    found = {"options": options, "results": results, "goals": GOALS}
    if args.json_path:  # gpu_check.sh: gpu_report.py prints these rows in its one table
        Path(args.json_path).write_text(json.dumps(found, indent=2))
    else:
        print(render(found))
    return 1 if any(r["status"] == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
