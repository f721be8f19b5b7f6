"""python scripts/bench_memory.py [--steps 4] [--warmup 1] [--systems fsdp2,zero3,fsdp2-noreshard,zero2] [--zerorun-config JSON] [--json out.json]

Model state against FSDP2, on the CPU (issue 20): 2 gloo ranks, bf16, AdamW, the 13.7M GPT
(vocab 4096, d_model 384, 6 layers, 128 tokens), micro-batch 4 per rank. For each system, in a
fresh world of spawned processes, after the steps:

- live tensor bytes per rank: every tensor storage reachable from Python (``gc.get_objects()``
  and the containers and instance dicts it returns, plus the optimizer's state and the module's
  parameters and buffers, an FSDP2 DTensor by its local shard), each storage counted once;
- peak RSS per rank over the process's life, and the median step time (wall and CPU).

zerorun runs the model in bf16 with fp32 masters (``precision.dtype: bf16``); FSDP2 keeps fp32
parameters and gathers them as bf16 with ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``, one unit per transformer block plus the root. zerorun stage 3 is compared
with FSDP2 ``reshard_after_forward=True`` and stage 2 with ``False``.

    python scripts/bench_memory.py --steps 2 --warmup 1          # a quick run
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

from bench_systems import (  # noqa: E402
    RankResult, Trainer, _local, _unique_bytes, build_trainer, model_device, run_world, time_steps,
)

SYSTEMS = ("fsdp2", "zero3", "fsdp2-noreshard", "zero2")
PAIRS = {"zero3": ("fsdp2", 1.0), "zero2": ("fsdp2-noreshard", 1.34)}  # system: (baseline, target)


def model_config():
    from gpt import GPTConfig

    return GPTConfig(vocab_size=4096, seq_len=128, n_layer=6, n_head=6, d_model=384)


def live_tensor_bytes(*roots) -> int:
    """Bytes of every tensor storage reachable from Python, each storage counted once.

    Tensors and storages held only inside containers that the garbage collector does not track
    (a dict of plain tensors, a list of storages) are found by looking one level into every
    tracked list, tuple, dict, set and instance ``__dict__``; ``roots`` (optimizer state, module
    parameters) are added explicitly.
    """
    import warnings

    import torch

    gc.collect()
    found: list = []

    def take(value) -> None:
        if isinstance(value, torch.Tensor):
            if value.device.type != "meta":
                found.append(_local(value) if hasattr(value, "to_local") else value)
        elif isinstance(value, torch.UntypedStorage):
            found.append(value)

    with warnings.catch_warnings():  # reading some objects' attributes warns (deprecations)
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            take(obj)
            if isinstance(obj, dict):
                for value in list(obj.values()):
                    take(value)
            elif isinstance(obj, (list, tuple, set, frozenset)):
                for value in list(obj):
                    take(value)
            else:
                inner = getattr(obj, "__dict__", None) if not isinstance(obj, type) else None
                if isinstance(inner, dict):
                    for value in list(inner.values()):
                        take(value)
    for root in roots:
        for value in root:
            take(value)
    return _unique_bytes([t if isinstance(t, torch.Tensor) else torch.empty(0, dtype=torch.uint8).set_(t)
                          for t in found])


def build(system: str, model, lr: float, zerorun_config: dict):
    """FSDP2 with bf16 compute and fp32 reduction; zerorun in bf16 (bench_systems.build_trainer)."""
    import torch
    from gpt import Block

    if not system.startswith("fsdp2"):
        return build_trainer(system, model, lr=lr, precision="bf16", block_class=Block, zerorun_config=zerorun_config)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reshard = system == "fsdp2"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in (m for m in model.modules() if isinstance(m, Block)):
        fully_shard(block, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    assert model_device(model).type == "cpu"
    return Trainer(model, optimizer, model)


def rank_main(rank: int, world: int, system: str, options: dict, init_file: str) -> RankResult:
    import torch
    import torch.distributed as dist
    from gpt import GPT, rank_slice, synthetic_batch

    torch.set_num_threads(options["threads"])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = model_config()
    torch.manual_seed(0)
    trainer = build(system, GPT(cfg), lr=1e-4, zerorun_config=options["zerorun_config"])

    def batches(step: int):
        tokens, targets = synthetic_batch(cfg, options["micro_batch"] * world, step=step)
        return rank_slice(tokens, rank, world), rank_slice(targets, rank, world)

    result = time_steps(trainer, batches, options["warmup"], options["steps"], synchronize=lambda: None)
    if hasattr(trainer, "engine"):
        module, optimizer = trainer.engine.module, trainer.engine.optimizer
        result.extra["breakdown"] = {k: int(v) for k, v in trainer.engine.memory_breakdown().items()}
    else:
        module, optimizer = trainer.model, trainer.optimizer
    state = [v for s in optimizer.state.values() for v in s.values()]
    result.extra["live_bytes"] = live_tensor_bytes(state, list(module.parameters()), list(module.buffers()))
    return result


def run_system(system: str, options: dict, workdir: Path) -> dict:
    """One world; per-rank figures read back from the ranks' JSON files."""
    summary = run_world(rank_main, options["nproc"], system, options, workdir)
    if summary.error:
        return {"system": system, "error": summary.error}
    ranks = [json.loads((workdir / system / f"rank{r}.json").read_text()) for r in range(options["nproc"])]
    mib = 1024 ** 2
    return {
        "system": system,
        "live_mib": [r["extra"]["live_bytes"] / mib for r in ranks],
        "peak_rss_mib": [r["peak_rss_bytes"] / mib for r in ranks],
        "step_s": summary.step_s,
        "step_cpu_s": summary.step_cpu_s,
        "last_loss": summary.last_loss,
        "breakdown": ranks[0]["extra"].get("breakdown"),
    }


def main(argv=None) -> int:
    import os

    from gpt import GPT, count_parameters

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--zerorun-config", default="{}", help="JSON merged into every zerorun config")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    try:
        zerorun_config = json.loads(args.zerorun_config)
    except json.JSONDecodeError as err:
        parser.error(f"--zerorun-config is not JSON: {err}")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or args.steps < 1 or args.warmup < 0 or args.micro_batch < 1:
        parser.error(f"systems from {','.join(SYSTEMS)}; --steps, --micro-batch >= 1, --warmup >= 0")
    nproc = 2
    options = {"steps": args.steps, "warmup": args.warmup, "micro_batch": args.micro_batch, "nproc": nproc,
               "threads": max(1, (os.cpu_count() or 1) // nproc), "zerorun_config": zerorun_config}
    print(f"GPT vocab 4096, d 384, 6 layers: {count_parameters(GPT(model_config())):,} params, bf16, AdamW, "
          f"{nproc} gloo ranks, {args.warmup} warmup + {args.steps} steps")
    results = {}
    with tempfile.TemporaryDirectory(prefix="zerorun-bench-memory-") as workdir:
        for system in systems:
            results[system] = run_system(system, options, Path(workdir))
            r = results[system]
            if "error" in r:
                print(f"{system:16s} failed: {r['error']}")
                continue
            print(f"{system:16s} live MiB/rank {' '.join(f'{v:6.1f}' for v in r['live_mib'])}  "
                  f"peak RSS MiB/rank {' '.join(f'{v:6.0f}' for v in r['peak_rss_mib'])}  "
                  f"step {r['step_s']:.3f} s ({r['step_cpu_s']:.3f} s CPU)  loss {r['last_loss']:.4f}")
            if r.get("breakdown"):
                print(f"{'':16s} memory_breakdown MiB: " + ", ".join(
                    f"{k} {v / 2 ** 20:.1f}" for k, v in r["breakdown"].items() if v))
    failed = False
    for system, (base, target) in PAIRS.items():
        mine, theirs = results.get(system), results.get(base)
        if not mine or not theirs or "error" in mine or "error" in theirs:
            continue
        live = max(mine["live_mib"]) / max(theirs["live_mib"])
        rss = max(mine["peak_rss_mib"]) / max(theirs["peak_rss_mib"])
        step = mine["step_s"] / theirs["step_s"]
        cpu = mine["step_cpu_s"] / theirs["step_cpu_s"]
        verdict = "ok" if live <= target else "OVER"
        failed |= live > target
        print(f"{system} / {base}: live bytes {live:.3f}x (target <= {target}: {verdict}), "
              f"peak RSS {rss:.3f}x, step {step:.2f}x wall, {cpu:.2f}x CPU")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2))
    return 1 if failed or any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
