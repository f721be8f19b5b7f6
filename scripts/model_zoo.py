"""python scripts/model_zoo.py [--stage 3] [--only llama,opt] [--worlds 1] [--fine [--setting TAG]] [--resume DIR [--no-run]] [--out docs/zoo.md] — Hugging Face families on zerorun.

Every model family in transformers' auto mappings for causal LM, masked LM, seq-to-seq LM and
image classification is built from a tiny config on the CPU (``tiny_config``: the family's
config defaults with the common size fields shrunk) and trained 3 steps on 2 gloo ranks at the
given ZeRO stage, its per-step losses compared with plain torch on the same global batch (fp32,
1e-4 relative; ``reference_losses`` says how the batch's gradient is formed). PEFT LoRA variants (a frozen base, trainable adapters) run as families of their
own. All families share one 2-rank world, trained in turn (a world per family would spend most
of its time starting processes and importing transformers); if a family takes the world down,
a new world goes on with the next one. The table goes to ``--out`` (docs/zoo.md).

``--fine`` runs the fine set instead (``fine_plan_jobs``, its table written to docs/zoo_fine.md): every module
that holds parameters gathers its own unit (``allgather_bucket_size: 1``), as a real model's
blocks and experts do, with the CPU gather pool on and off (off, units free and re-allocate
their storage as CUDA units do); the text families also under Hugging Face's gradient
checkpointing (reentrant and not); every family with PEFT LoRA on its attention projections,
and on them and its input embedding, and in bf16 against plain torch's own bf16 (these three
pool off: scripts/zoo_settings.py); the MoE set (``MOE_FAMILIES``, with a plain per-expert MoE
from scripts/zoo_plain_moe.py) on a batch whose rank-0 rows repeat one token, so that rank 0's
routers leave experts idle that rank 1 runs. Each job is a family at a stage under a ``Setting``.
``--setting`` runs only the fine jobs of that setting; ``--resume`` keeps what an earlier run
logged under its ``--work`` folder and runs the rest (scripts/zoo_table.py), so the fine set,
hours on 2 loaded cores, can be run in parts.

Outcomes: ``passed``; ``failed`` (zerorun raised, or the losses differ: the error's first line);
``skipped`` (the tiny config does not build, or plain torch cannot train the model on the inputs
generated here: a family that needs audio, a package we lack, or inputs beyond token ids or
pixels; the reason is the error's first line). Models run in eval mode: dropout, drop-path,
layer-drop and batch statistics would otherwise differ between a rank's half batch and the
whole batch under any data parallelism, which is not what is compared.

tests/integrations/test_model_zoo.py runs a named sample of these by default and the whole zoo
(and the fine set) under ``-m zoo``.

This file is the command line, the fine set's jobs and the table's text; the rest is one concern
a module, each imported from scripts/: zoo_families.py (the families and their tiny models),
zoo_settings.py (``Setting``; LoRA and bf16 alike for plain torch and zerorun), zoo_run.py (one
family in a world, plain torch's losses and zerorun's, its ``Outcome``), zoo_worlds.py (the
2-rank worlds, their logs, and reading logs back for ``--resume``), zoo_table.py (the table),
zoo_plain_moe.py (a plain per-expert MoE).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from zoo_families import GLOBAL_BATCH, LORA_SUFFIX, MOE_FAMILIES, Family, all_families, select
from zoo_run import STEPS, WORLD, Job, Outcome
from zoo_settings import BF16_TOLERANCE, DEFAULT, PREFETCH_SHARE, TOLERANCE, Setting
from zoo_worlds import logged, run_zoo, run_zoo_parallel

# What tests/integrations/test_model_zoo.py takes from here.
__all__ = ["DEFAULT", "STEPS", "Setting", "all_families", "fine_plan_jobs", "main", "run_zoo", "select", "summary"]


def fine_plan_jobs(families: list[Family]) -> list[Job]:
    """The ``fine`` set at stage 3: every family with every module its own unit, with the gather
    pool on and off (the GPU path emulated); the text families also under Hugging Face's
    gradient checkpointing, reentrant and not; every family with PEFT LoRA on its attention
    projections, and on them and its input embedding (the LoRA families of the plain zoo are
    LoRA already), and in bf16; these with the pool off, the path the GPU takes; every family with
    a prefetch budget (Setting.prefetch), pool on and off, and with the pool off also under
    non-reentrant checkpointing (text families), LoRA on the attention projections and, for the
    MoE set, a skewed batch; the MoE set on a skewed batch, pool on and off; every family with
    the pool off, a prefetch budget and a tied embedding's rows (Setting.rows)."""
    text = [f for f in families if f.task != "image-classification"]
    base = [f for f in families if not f.model_type.endswith(LORA_SUFFIX)]
    jobs = [(f, 3, Setting("fine", pool=pool)) for pool in (True, False) for f in families]
    jobs += [(f, 3, Setting("fine", kind, pool=False)) for kind in ("reentrant", "non-reentrant") for f in text]
    jobs += [(f, 3, Setting("fine", pool=False, lora=lora)) for lora in ("attention", "attention+embedding") for f in base]
    jobs += [(f, 3, Setting("fine", pool=False, dtype="bf16")) for f in families]
    jobs += [(f, 3, Setting("fine", pool=pool, prefetch=True)) for pool in (True, False) for f in families]
    jobs += [(f, 3, Setting("fine", "non-reentrant", pool=False, prefetch=True)) for f in text]
    jobs += [(f, 3, Setting("fine", pool=False, lora="attention", prefetch=True)) for f in base]
    moe = [f for f in families if f.name in MOE_FAMILIES]
    jobs += [(f, 3, Setting("fine", pool=pool, skew=True)) for pool in (True, False) for f in moe]
    jobs += [(f, 3, Setting("fine", pool=False, skew=True, prefetch=True)) for f in moe]
    jobs += [(f, 3, Setting("fine", pool=False, prefetch=True, rows=True)) for f in families]
    return jobs


# -- the table -----------------------------------------------------------------------------
def summary(outcomes: list[Outcome]) -> dict[str, int]:
    from zoo_table import summary as count

    return count(outcomes)


def write_table(outcomes: list[Outcome], path: Path, command: str, fine: bool = False, planned: int = 0) -> None:
    import transformers
    from zoo_table import overview, write_table as write

    intro = (
        f"Generated by `{command}` (scripts/model_zoo.py; transformers {transformers.__version__}, "
        f"torch {torch.__version__}). Each family of transformers' causal-LM, masked-LM, seq-to-seq-LM "
        "and image-classification auto mappings is built from a tiny config on the CPU and trained "
        f"{STEPS} steps with AdamW on {WORLD} gloo ranks, each rank half of a global batch of {GLOBAL_BATCH}; "
        f"its per-step losses are compared with plain torch in one process on the whole batch, the batch's "
        f"gradient formed as the mean of its halves' as data parallelism forms it (fp32, {TOLERANCE:g} relative). "
        "`+lora` rows are PEFT LoRA (r=4 on q_proj and v_proj) over a frozen base. Skipped: the tiny "
        "config does not build, or plain torch itself cannot train the model on token ids or pixels "
        "(audio, extra inputs, missing packages); the reason is the error's first line. "
        "Models run in eval mode (no dropout, drop-path or batch statistics, which differ between a "
        "rank's half batch and the whole batch under any data parallelism).")
    title = "Model zoo: Hugging Face families on zerorun"
    if fine:
        title += ", the fine set"
        intro += (
            "\n\nThe fine set (`fine_plan_jobs`), all at stage 3 with every module that holds parameters "
            "its own unit (`fine`: `allgather_bucket_size: 1`). `no-pool`: the CPU gather pool off, so "
            "units free and re-allocate their storage as CUDA units do (the GPU path, emulated). "
            "`ckpt=`: Hugging Face's `gradient_checkpointing_enable` (use_reentrant true or false) in "
            "training mode. `lora=`: PEFT LoRA (r=4) on every linear layer inside an attention module "
            "(scripts/zoo_settings.py), and on the input embedding too; a family without them is "
            "skipped with the reason. `bf16`: zerorun's bf16 mixed precision against plain torch's own "
            "(a bf16 model, fp32 masters stepped by AdamW, bf16 gradients), "
            f"{BF16_TOLERANCE:g} relative: the same roundings at the same points on both sides, exact at 2 ranks, "
            "but in AdamW's kernel (zerorun's fused on a CPU, plain torch's per-tensor: an fp32 ulp apart in "
            "some masters, now and then a bf16 weight a step apart; scripts/zoo_settings.py says why and how much). "
            f"`prefetch`: `prefetch_bucket_size` set to {PREFETCH_SHARE:g} of the model's elements, so stage 3's "
            "window reaches several units ahead and runs on from forward's end into backward, as a DeepSpeed "
            "config's budget asks. `rows`: `zero.tied_embedding_rows`, so a token embedding tied to the output "
            "head reads only the rows it looks up and sends its lookup's gradient as rows (a family without "
            "one trains as without it). "
            "`skew`: the MoE set (Mixtral, Qwen2-MoE, OLMoE, Switch Transformers, a plain per-expert "
            "MoE) on a batch whose rank-0 rows repeat one token, so that rank 0's routers leave experts "
            "idle that rank 1 runs.\n\n" + "\n".join(overview(outcomes)))
    if planned > len(outcomes):
        intro += (f"\n\n**{len(outcomes)} of the {planned} jobs have run**; the rest have not (a family at a "
                  "setting missing from its section below): `--resume` runs them.")
    write(outcomes, path, title, intro)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, action="append", help="ZeRO stage(s) to run (default 3)")
    parser.add_argument("--only", default="", help="comma-separated families (task/model_type or model_type)")
    parser.add_argument("--out", type=Path, help="the table (default docs/zoo.md; with --fine docs/zoo_fine.md)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/zerorun-model-zoo"))
    parser.add_argument("--worlds", type=int, default=1, help="2-rank worlds run at once, the families dealt over them")
    parser.add_argument("--fine", action="store_true",
                        help="the fine set instead (every module its own unit; checkpointing, LoRA, bf16, pool off, MoE skew)")
    parser.add_argument("--setting", action="append", default=[],
                        help="with --fine: only the jobs of this setting (its tag, as the table's headings write it)")
    parser.add_argument("--resume", type=Path, action="append", default=[],
                        help="keep the outcomes logged under this --work folder of an earlier run (a later "
                             "--resume's replace an earlier's); run the rest")
    parser.add_argument("--no-run", action="store_true", help="with --resume: run nothing, write the table of what is logged")
    args = parser.parse_args(argv)
    args.out = args.out or Path("docs/zoo_fine.md" if args.fine else "docs/zoo.md")
    families = all_families()
    if args.only:
        families = select(families, [n.strip() for n in args.only.split(",") if n.strip()])
    stages = args.stage or [3]
    if any(s not in (0, 1, 2, 3) for s in stages):
        parser.error("--stage must be 0, 1, 2 or 3")
    jobs: list[Job] = [(family, stage, DEFAULT) for stage in stages for family in families]
    if args.fine:
        jobs = fine_plan_jobs(families)
        if args.setting:
            jobs = [job for job in jobs if job[2].tag in args.setting]
    started = time.perf_counter()
    if args.worlds < 1:
        parser.error("--worlds must be at least 1")
    outcomes = logged(jobs, args.resume)
    done = {(o.family, o.stage, o.setting) for o in outcomes}
    rest = [job for job in jobs if (job[0].name, job[1], job[2].tag) not in done]
    if args.fine:  # the MoE set first, then family by family: a run cut short covers every setting alike
        first = {family.name: n for n, family in enumerate(families)}
        rest.sort(key=lambda job: (not job[2].skew, first[job[0].name]))
    print(f"{len(jobs)} jobs, {len(outcomes)} logged, {0 if args.no_run else len(rest)} to run", flush=True)
    if rest and not args.no_run:
        outcomes += run_zoo_parallel(rest, args.work / str(os.getpid()), args.worlds)
    command = "python scripts/model_zoo.py" + "".join(f" --stage {s}" for s in args.stage or []) + \
        (f" --only {args.only}" if args.only else "") + (f" --worlds {args.worlds}" if args.worlds > 1 else "") + \
        (" --fine" if args.fine else "") + "".join(f" --setting {t}" for t in args.setting) + \
        "".join(f" --resume {d}" for d in args.resume) + (" --no-run" if args.no_run else "")
    place = {(family.name, stage, setting.tag): n for n, (family, stage, setting) in enumerate(jobs)}
    outcomes.sort(key=lambda o: place[(o.family, o.stage, o.setting)])
    write_table(outcomes, args.out, command, fine=args.fine, planned=len(jobs))
    for stage in stages:
        counts = summary([o for o in outcomes if o.stage == stage])
        print(f"stage {stage}: {counts}")
    print(f"{args.out}: {len(outcomes)} rows in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # zerorun from this checkout, unless PYTHONPATH says
    sys.exit(main())
