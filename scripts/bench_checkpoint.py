"""python scripts/bench_checkpoint.py [--preset bench] [--stage 3] [--repeats 3] [--nproc 2] [--json out.json]

Checkpoint save and load against the peer, in one run: the GPT of examples/gpt.py (preset
"bench": 33.7M parameters), fp32, AdamW after one training step (so Adam's moments exist),
2 gloo ranks on CPU. In the same world, and on the same disk:

  zerorun   engine.save_checkpoint / a fresh engine's load_checkpoint (zerorun/zero/checkpoint/save.py, load.py:
            fsynced files, checksums, manifest, atomic commit)
  dcp       torch.distributed.checkpoint.save / load of an FSDP2 model of the same size
            (fully_shard per Block and the root, as scripts/bench_systems.py sets it up), with
            get_state_dict / set_state_dict for model and optimizer

Reported per system: save and load seconds (median of --repeats, the slowest rank's time each,
every rank timed between two barriers), bytes each rank wrote, and zerorun / dcp ratios. DCP
does not fsync nor checksum; zerorun does both, so its save pays for durability. The disk's page
cache is warm for loads of either system (the files were just written).

    python scripts/bench_checkpoint.py --preset tiny --repeats 1     # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "examples"))


def parse_args(argv=None) -> argparse.Namespace:
    from gpt import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench", choices=sorted(PRESETS))
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3), help="zerorun's ZeRO stage")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--json", dest="json_path", default=None)
    return parser.parse_args(argv)


def _timed(fn, barrier) -> float:
    barrier()
    start = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - start


def _train_one_step(step_fn, cfg, rank: int, world: int) -> None:
    from gpt import rank_slice, synthetic_batch

    tokens, targets = synthetic_batch(cfg, 4 * world, step=0)
    step_fn(rank_slice(tokens, rank, world), rank_slice(targets, rank, world))


def _dir_bytes(path: Path, rank: int, names) -> int:
    return sum((path / n).stat().st_size for n in names(path, rank) if (path / n).exists())


def zerorun_rank(rank: int, world: int, options: dict, root: Path) -> dict:
    import torch
    import torch.distributed as dist

    import zerorun
    from gpt import GPT, preset

    cfg = preset(options["preset"])
    config = {"zero": {"stage": options["stage"]}}

    def build():
        torch.manual_seed(0)
        model = GPT(cfg)
        return zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)

    engine = build()

    def step(tokens, targets):
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()

    _train_one_step(step, cfg, rank, world)
    saves, loads = [], []
    fresh = build()
    for repeat in range(options["repeats"]):
        target = root / "zerorun" / f"r{repeat}"
        saves.append(_timed(lambda target=target: engine.save_checkpoint(target), dist.barrier))
        loads.append(_timed(lambda target=target: fresh.load_checkpoint(target), dist.barrier))
    tag = root / "zerorun" / "r0" / f"global_step{engine.global_step}"
    own = [f"rank{rank}.safetensors"] + (["manifest.json", "engine.pt"] if rank == 0 else [])
    written = sum((tag / name).stat().st_size for name in own)
    same = all(torch.equal(a, b) for a, b in zip(engine.full_state_dict().values(), fresh.full_state_dict().values(), strict=True))
    return {"save_s": saves, "load_s": loads, "bytes": written, "loaded_equal": same}


def dcp_rank(rank: int, world: int, options: dict, root: Path) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from gpt import GPT, Block, preset

    cfg = preset(options["preset"])

    def build():
        torch.manual_seed(0)
        model = GPT(cfg)
        for block in [m for m in model.modules() if isinstance(m, Block)]:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    model, optimizer = build()

    def step(tokens, targets):
        model(tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _train_one_step(step, cfg, rank, world)
    fresh_model, fresh_optimizer = build()

    def save(target):
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(target))

    def load(target):
        model_state, optim_state = get_state_dict(fresh_model, fresh_optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(target))
        set_state_dict(fresh_model, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    saves, loads = [], []
    for repeat in range(options["repeats"]):
        target = root / "dcp" / f"r{repeat}"
        saves.append(_timed(lambda target=target: save(target), dist.barrier))
        loads.append(_timed(lambda target=target: load(target), dist.barrier))
    first = root / "dcp" / "r0"
    own = [p for p in first.iterdir() if p.name.startswith(f"__{rank}_")] + ([first / ".metadata"] if rank == 0 else [])
    return {"save_s": saves, "load_s": loads, "bytes": sum(p.stat().st_size for p in own)}


def rank_entry(rank: int, world: int, options: dict, workdir: str) -> None:
    import torch
    import torch.distributed as dist

    from zerorun.zero.comm.process_group import leaving_together

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world)
    root = Path(workdir)
    with leaving_together():
        result = {"zerorun": zerorun_rank(rank, world, options, root), "dcp": dcp_rank(rank, world, options, root)}
    (root / f"result{rank}.json").write_text(json.dumps(result))


def summarize(ranks: list[dict]) -> dict:
    out = {}
    for system in ("zerorun", "dcp"):
        per = [r[system] for r in ranks]
        repeats = len(per[0]["save_s"])
        slowest = lambda key, per=per, repeats=repeats: [max(p[key][i] for p in per) for i in range(repeats)]
        out[system] = {"save_s": statistics.median(slowest("save_s")), "load_s": statistics.median(slowest("load_s")),
                       "bytes_per_rank": [p["bytes"] for p in per]}
    out["ratio"] = {k: out["zerorun"][k] / out["dcp"][k] for k in ("save_s", "load_s")}
    out["ratio"]["bytes"] = sum(out["zerorun"]["bytes_per_rank"]) / sum(out["dcp"]["bytes_per_rank"])
    out["zerorun_loaded_equal"] = all(r["zerorun"]["loaded_equal"] for r in ranks)
    return out


def main(argv=None) -> int:
    import torch.multiprocessing as mp

    from gpt import GPT, count_parameters, preset

    args = parse_args(argv)
    options = {"preset": args.preset, "stage": args.stage, "repeats": args.repeats}
    params = count_parameters(GPT(preset(args.preset)))
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="zerorun-bench-ckpt-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        mp.start_processes(rank_entry, args=(args.nproc, options, str(workdir)), nprocs=args.nproc,
                           start_method="spawn", join=True)
        result = summarize([json.loads((workdir / f"result{r}.json").read_text()) for r in range(args.nproc)])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result.update(preset=args.preset, params=params, stage=args.stage, nproc=args.nproc, repeats=args.repeats)
    print(f"GPT {args.preset}: {params:,} params, fp32, AdamW, {args.nproc} gloo ranks; median of {args.repeats}")
    print(f"{'system':<28}{'save s':>9}{'load s':>9}{'MiB per rank':>22}")
    for system, label in (("zerorun", f"zerorun stage {args.stage}"), ("dcp", "FSDP2 + torch DCP")):
        r = result[system]
        sizes = " / ".join(f"{b / 2**20:.1f}" for b in r["bytes_per_rank"])
        print(f"{label:<28}{r['save_s']:>9.3f}{r['load_s']:>9.3f}{sizes:>22}")
    ratio = result["ratio"]
    print(f"{'zerorun / dcp':<28}{ratio['save_s']:>8.2f}x{ratio['load_s']:>8.2f}x{ratio['bytes']:>21.2f}x")
    print(f"zerorun load reproduces the saved model exactly: {result['zerorun_loaded_equal']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
