"""python scripts/bench_gpu.py [--steps 10] [--warmup 3] [--json results.json]

The GPU benchmark of issue 2: a Llama-shaped 1.26B-parameter model (examples/llama.py), bf16,
activation checkpointing on every LlamaBlock, batch 8 x 2048 tokens per rank, AdamW, trained by
FSDP2 (``fully_shard`` with bf16 params, fp32 sharded master) and zerorun stages 0-3 in the same
run. Target: every zerorun stage <= 1.0x FSDP2's step time. GUIDE §5 lists the peers measured on
one H100 (FSDP2 0.486 s/step, 255 model TFLOPS, 21.9 GiB).

One rank by default (NCCL on the GPU). ``--nproc 2`` runs two ranks on the one GPU over gloo
with CUDA tensors (NCCL refuses two ranks on one device, GUIDE §6): correct, but its step time
measures gloo, not the GPU.

    python scripts/bench_gpu.py --dry-run     # tiny model on CPU, 2 gloo ranks: exercises the code
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

from bench_systems import SYSTEMS, RankResult, build_trainer, parse_shared_options, render_table, run_world, time_steps  # noqa: E402

DEFAULT_SYSTEMS = ("fsdp2", "zero0", "zero1", "zero2", "zero3")
TARGETS = {f"zero{stage}": {"step": 1.0} for stage in range(4)}


def parse_args(argv=None) -> argparse.Namespace:
    from llama import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1.3b", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (0: the preset's)")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--no-checkpointing", action="store_true", help="keep all activations")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma list from {','.join(SYSTEMS)}")
    parser.add_argument("--zerorun-config", default="{}", help="JSON merged into every zerorun config")
    parser.add_argument("--dry-run", action="store_true", help="tiny preset on CPU, 2 ranks, 2 steps")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.preset, args.steps, args.warmup, args.micro_batch, args.nproc = "tiny", 2, 1, 2, 2
    parse_shared_options(parser, args)
    if args.steps < 1 or args.warmup < 0 or args.nproc < 1 or args.micro_batch < 1:
        parser.error("--steps, --nproc and --micro-batch must be >= 1, --warmup >= 0")
    return args


def rank_main(rank: int, world: int, system: str, options: dict, init_file: str) -> RankResult:
    import torch
    import torch.distributed as dist
    from llama import PRESETS, Llama, LlamaBlock

    from zerorun.zero.activation_checkpointing import apply_activation_checkpointing

    use_cuda = options["device"] == "cuda"
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    backend = "nccl" if use_cuda and world == 1 else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = dataclasses.replace(PRESETS[options["preset"]], **({"seq_len": options["seq_len"]} if options["seq_len"] else {}))
    torch.manual_seed(0)
    with device:
        model = Llama(cfg)
    zerorun_config = json.loads(json.dumps(options["zerorun_config"]))
    if options["checkpointing"]:
        if system.startswith("zero"):
            zerorun_config.setdefault("activation_checkpointing", {"enabled": True, "modules": ["LlamaBlock"]})
        else:
            apply_activation_checkpointing(model, ["LlamaBlock"])
    trainer = build_trainer(system, model, lr=1e-4, precision="bf16", block_class=LlamaBlock,
                            zerorun_config=zerorun_config)
    params = sum(p.numel() for p in model.parameters())

    def batches(step: int):
        generator = torch.Generator().manual_seed(step * 100 + rank)
        tokens = torch.randint(0, cfg.vocab_size, (options["micro_batch"], cfg.seq_len + 1), generator=generator)
        tokens = tokens.to(device)
        return tokens[:, :-1], tokens[:, 1:]

    synchronize = torch.cuda.synchronize if use_cuda else (lambda: None)
    if use_cuda:
        torch.cuda.reset_peak_memory_stats()
    result = time_steps(trainer, batches, options["warmup"], options["steps"], synchronize)
    result.gpu_peak_bytes = torch.cuda.max_memory_allocated() if use_cuda else 0
    result.extra = {"params": params, "tokens_per_step": options["micro_batch"] * cfg.seq_len * world}
    return result


def main(argv=None) -> int:
    import torch
    from rich.console import Console

    args = parse_args(argv)
    console = Console(width=120) if not Console().is_terminal else Console()
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if device == "cpu" and not args.dry_run:
        console.print("[yellow]no CUDA device: running on CPU (use --dry-run for a quick check)[/yellow]")
    options = {"preset": args.preset, "steps": args.steps, "warmup": args.warmup, "device": device,
               "micro_batch": args.micro_batch, "seq_len": args.seq_len,
               "checkpointing": not args.no_checkpointing, "zerorun_config": args.zerorun_config}
    results = []
    with tempfile.TemporaryDirectory(prefix="zerorun-bench-gpu-") as workdir:
        for system in args.systems:
            console.print(f"  {system} ...", end=" ")
            result = run_world(rank_main, args.nproc, system, options, Path(workdir))
            results.append(result)
            console.print(f"failed: {result.error}" if result.error else f"{result.step_s:.3f} s/step")
            if not result.error:
                extra = json.loads((Path(workdir) / system / "rank0.json").read_text())["extra"]
                result_tflops = 6 * extra["params"] * extra["tokens_per_step"] / result.step_s / 1e12 / args.nproc
                console.print(f"      {extra['params']:,} params, {result_tflops:.3g} model TFLOPS per rank")
    console.print(render_table(f"GPU benchmark on {device} (ratios against FSDP2 in this run)", results,
                               "fsdp2", TARGETS, gpu=device == "cuda"))
    for r in results:
        if r.error:
            console.print(f"[red]{r.system} failed:[/red] {r.error}")
    if args.json_path:
        payload = {"options": {**options, "nproc": args.nproc, "device": device},
                   "results": [dataclasses.asdict(r) for r in results]}
        Path(args.json_path).write_text(json.dumps(payload, indent=2))
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
