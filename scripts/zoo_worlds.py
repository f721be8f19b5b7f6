"""Imported by scripts/model_zoo.py: the 2-rank worlds the jobs run in, and their logs.

    python scripts/model_zoo.py --worlds 2 --resume /tmp/zerorun-model-zoo/1234

All the jobs of a world share it, trained in turn (a world per family would spend most of its
time starting processes and importing transformers); each rank logs a line as a job starts and
its ``Outcome`` as it ends (``rank{r}-{tag}.jsonl``). If a family takes the world down, a new
world goes on with the next job, and the family's outcome goes to ``crashes.jsonl``; ``logged``
reads both back for ``--resume`` (scripts/zoo_table.py).
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
from zoo_run import WORLD, Job, Outcome, first_line, run_family

def _resident_mib() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
    except OSError:  # not Linux
        return 0


def _world_tag(jobs: list[Job]) -> str:
    """Names one world's files: each world starts at a different job, and a crashed world's
    log must survive the next one (the families it finished are read from it)."""
    return f"{len(jobs)}-{jobs[0][0].name.replace('/', '_')}"


def _worker(rank: int, out_dir: str, jobs: list[Job]) -> None:
    import warnings

    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on two shared cores
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    from datetime import timedelta

    # An hour: a rank waits in a collective while its peer computes, and bf16 convolutions on a
    # CPU without bf16 units are slow (TextNet's 640x640 tiny model: 53 s for one forward and
    # backward of 2 images in bf16, 4 s in fp32), so 600 s ended TextNet's bf16 job mid-step.
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous-{_world_tag(jobs)}",
                            rank=rank, world_size=WORLD, timeout=timedelta(seconds=3600))
    from zerorun.zero.comm.process_group import leaving_together

    with leaving_together(), open(Path(out_dir) / f"rank{rank}-{_world_tag(jobs)}.jsonl", "a") as log:
        for family, stage, setting in jobs:
            log.write(json.dumps({"start": family.name, "stage": stage, "setting": setting.tag}) + "\n")
            log.flush()
            outcome = run_family(family, stage, rank, setting)
            gc.collect()  # the family's model, engine and hooks, before the next one is built
            outcome.rss_mib = _resident_mib()
            log.write(json.dumps(asdict(outcome)) + "\n")
            log.flush()


def run_zoo(jobs: list[Job], out_dir: Path) -> list[Outcome]:
    """Run ``jobs`` in 2-rank worlds, a new world after any family that ends one."""
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    done: list[Outcome] = []
    remaining = list(jobs)
    while remaining:
        log = out_dir / f"rank0-{_world_tag(remaining)}.jsonl"
        log.unlink(missing_ok=True)
        crash = None
        try:
            mp.start_processes(_worker, args=(str(out_dir), remaining), nprocs=WORLD, start_method="spawn", join=True)
        except Exception as error:  # a rank died: what it finished is in its log
            crash = first_line(error)
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        finished = [Outcome(**{**r, "trainable": tuple(r["trainable"])}) for r in records if "status" in r]
        done += finished
        remaining = remaining[len(finished):]
        if crash is not None and remaining:
            family, stage, setting = remaining.pop(0)
            done.append(Outcome(family.name, stage, "failed", setting.tag, f"the world ended while it ran: {crash}",
                                error_type="WorldCrash"))
            with open(out_dir / "crashes.jsonl", "a") as crashes:  # zoo_table.logged_records reads it
                crashes.write(json.dumps(asdict(done[-1])) + "\n")
    return done


def run_zoo_parallel(jobs: list[Job], out_dir: Path, worlds: int) -> list[Outcome]:
    """``jobs`` dealt over ``worlds`` 2-rank worlds that run at once (a family's outcome does not
    depend on its world: each is built, seeded and trained on its own), in the jobs' order."""
    from concurrent.futures import ThreadPoolExecutor

    if worlds <= 1:
        return run_zoo(jobs, out_dir)
    with ThreadPoolExecutor(worlds) as pool:
        parts = list(pool.map(lambda i: run_zoo(jobs[i::worlds], out_dir / f"world{i}"), range(worlds)))
    place = {(family.name, stage, setting.tag): n for n, (family, stage, setting) in enumerate(jobs)}
    return sorted((o for part in parts for o in part), key=lambda o: place[(o.family, o.stage, o.setting)])


def logged(jobs: list[Job], directories: list[Path]) -> list[Outcome]:
    """The outcomes of ``jobs`` logged under ``directories`` by earlier runs (zoo_table.logged_records)."""
    from zoo_table import logged_records

    wanted = {(family.name, stage, setting.tag) for family, stage, setting in jobs}
    return [Outcome(**{**r, "trainable": tuple(r["trainable"])}) for r in logged_records(directories)
            if (r["family"], r["stage"], r["setting"]) in wanted]
