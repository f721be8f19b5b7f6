"""``zerorun estimate --params 7B --gpus 8``: plan the memory of a ZeRO job before starting it.

Thin shell over zerorun.planner: it turns flags into a ModelSpec, a Job and a Training,
asks the pure planner for every (stage, offload) option, and prints the table (or JSON).
Precedence: flags > --config file > defaults (bf16 mixed precision, Adam, stage 0).
The formulas behind every column are in docs/estimate.md.
"""

from __future__ import annotations


import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import typer

from zerorun.errors import PlannerError


def register(app: typer.Typer) -> None:
    @app.command("estimate", help="Estimate per-GPU, per-host and NVMe memory for every ZeRO stage and offload option.")
    def estimate_command(
        params: Optional[str] = typer.Option(None, "--params", help="Parameter count, e.g. 7B, 1.3B, 350M."),
        preset: Optional[str] = typer.Option(None, "--preset", help="Named model: gpt2 .. gpt2-xl, llama-7b .. llama-70b, llama3-8b."),
        hf_config: Optional[Path] = typer.Option(None, "--hf-config", help="A Hugging Face config.json (or its folder)."),
        model: Optional[str] = typer.Option(None, "--model", help="module:function (or file.py:function) returning the model; built on the meta device."),
        gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs (ranks) per node (default 1)."),
        nodes: Optional[int] = typer.Option(None, "--nodes", help="Number of nodes (default 1)."),
        hostfile: Optional[Path] = typer.Option(None, "--hostfile", help="DeepSpeed-style hostfile ('host slots=N' lines)."),
        stage: Optional[int] = typer.Option(None, "--stage", help="The stage you plan to use (marked * in the table)."),
        precision: Optional[str] = typer.Option(None, "--precision", help="bf16, fp16 (16-bit mixed precision) or fp32 (default bf16)."),
        offload: Optional[str] = typer.Option(None, "--offload", help="none, cpu-optimizer, cpu-optimizer+params or nvme (default none)."),
        config: Optional[Path] = typer.Option(None, "--config", help="zerorun YAML/JSON (or DeepSpeed JSON) config: stage, precision, offload, buckets."),
        micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Micro-batch size per GPU, for activations."),
        seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Sequence length in tokens, for activations."),
        activation_checkpointing: Optional[bool] = typer.Option(None, "--activation-checkpointing/--no-activation-checkpointing", help="Recompute layer activations in backward."),
        gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="Memory per GPU, e.g. 80GB or 80GiB (a bare number is GB)."),
        host_memory: Optional[str] = typer.Option(None, "--host-memory", help="CPU memory per host, e.g. 512GB."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
        measure: bool = typer.Option(False, "--measure", help="Also run a few real steps (needs --model) and print the measured peak beside the estimate."),
        measure_ranks: int = typer.Option(2, "--measure-ranks", help="Ranks for --measure (gloo on CPU; on GPUs NCCL, one rank per GPU)."),
        measure_steps: int = typer.Option(3, "--measure-steps", help="Optimizer steps for --measure."),
        link: Optional[str] = typer.Option(None, "--link", help="Rate of the link between hosts, e.g. 300Mbit or 25Gbit: print the bytes each rank sends per step and the link time."),
        compute_s: Optional[float] = typer.Option(None, "--compute-s", help="With --link: a step's compute time in seconds (measured on one host), for the bound max(link, compute)."),
    ) -> None:
        request = EstimateRequest(
            params=params, preset=preset, hf_config=hf_config, model=model, gpus=gpus, nodes=nodes,
            hostfile=hostfile, stage=stage, precision=precision, offload=offload, config=config,
            micro_batch=micro_batch, seq_len=seq_len, activation_checkpointing=activation_checkpointing,
            gpu_memory=gpu_memory, host_memory=host_memory,
        )
        plan = build_plan(request)
        traffic = _traffic(plan, link, compute_s)
        measured = None
        if measure:
            measured = _run_measurement(request, plan, measure_ranks, measure_steps)
        _print(plan, measured, as_json, traffic)


@dataclass(frozen=True)
class EstimateRequest:
    """The flags, as given (None = not given), so flags can override the config file."""

    params: str | None = None
    preset: str | None = None
    hf_config: Path | None = None
    model: str | None = None
    gpus: int | None = None
    nodes: int | None = None
    hostfile: Path | None = None
    stage: int | None = None
    precision: str | None = None
    offload: str | None = None
    config: Path | None = None
    micro_batch: int | None = None
    seq_len: int | None = None
    activation_checkpointing: bool | None = None
    gpu_memory: str | None = None
    host_memory: str | None = None


def build_plan(request: EstimateRequest):
    from zerorun.planner.plan import Limits, make_plan
    from zerorun.planner.quantities import parse_bytes

    model_spec = resolve_model(request)
    job = resolve_job(request)
    training, file_activation = resolve_training(request)
    activation_job = resolve_activations(request, file_activation)
    limits = Limits(
        gpu_bytes=parse_bytes(request.gpu_memory) if request.gpu_memory is not None else None,
        host_bytes=parse_bytes(request.host_memory) if request.host_memory is not None else None,
    )
    return make_plan(model_spec, job, training, activation_job, limits)


def resolve_model(request: EstimateRequest):
    given = [name for name in ("params", "preset", "hf_config", "model") if getattr(request, name) is not None]
    if len(given) != 1:
        flags = ", ".join("--" + name.replace("_", "-") for name in given) or "none"
        raise PlannerError(
            f"give exactly one model source (got {flags})",
            hint="--params 7B, --preset llama-7b, --hf-config config.json or --model module:function",
        )
    if request.params is not None:
        from zerorun.planner.architecture import ModelSpec
        from zerorun.planner.quantities import format_count, parse_count

        count = parse_count(request.params)
        return ModelSpec(name=f"{format_count(count)}-parameter model", num_params=count)
    if request.preset is not None:
        from zerorun.planner.presets import preset_spec

        return preset_spec(request.preset)
    if request.hf_config is not None:
        from zerorun.planner.hf_config import read_hf_config

        return read_hf_config(request.hf_config)
    from zerorun.planner.counting import spec_from_factory

    assert request.model is not None  # exactly one source was given, and it was none of the others
    return spec_from_factory(request.model)


def resolve_job(request: EstimateRequest):
    from zerorun.planner.memory import Job

    if request.hostfile is not None:
        if request.nodes is not None:
            raise PlannerError("give --hostfile or --nodes, not both")
        from zerorun.launch.hostfile import parse_hostfile

        try:
            text = Path(request.hostfile).read_text()
        except OSError as err:
            raise PlannerError(f"cannot read hostfile {str(request.hostfile)!r}: {err.strerror}") from None
        slots = list(parse_hostfile(text, str(request.hostfile)).values())
        if request.gpus is not None:  # --gpus narrows every host to that many ranks
            slots = [min(s, request.gpus) for s in slots]
        return Job(gpus_per_node=max(slots), nodes=len(slots), total_ranks=sum(slots))
    return Job(gpus_per_node=1 if request.gpus is None else request.gpus,
               nodes=1 if request.nodes is None else request.nodes)


def resolve_training(request: EstimateRequest):
    """Training from the config file (if any), then flags on top; returns (training, file's activation bits)."""
    from zerorun.planner.memory import Training

    training = Training()
    file_activation: dict = {}
    if request.config is not None:
        training, file_activation = _training_from_config(request.config)
    overrides: dict[str, Any] = {}  # strings the planner checks (offload_supported, Training)
    if request.stage is not None:
        overrides["stage"] = request.stage
    if request.precision is not None:
        overrides["precision"] = request.precision.lower()
    if request.offload is not None:
        overrides["offload"] = request.offload.lower()
    training = replace(training, **overrides)
    from zerorun.planner.memory import offload_supported

    if not offload_supported(training.stage, training.offload):
        raise PlannerError(
            f"offload {training.offload!r} is not available at ZeRO stage {training.stage}",
            hint="optimizer offload needs --stage 1, 2 or 3; cpu-optimizer+params needs --stage 3",
        )
    return training, file_activation


def _training_from_config(path: Path):
    from zerorun.config import load_config
    from zerorun.errors import ConfigError
    from zerorun.planner.memory import Training

    if not Path(path).is_file():
        raise PlannerError(f"no config file at {str(path)!r}")
    try:
        cfg = load_config(str(path))
    except ConfigError:
        raise
    except Exception as err:  # the loader is another issue's; surface its failure as one line
        raise PlannerError(f"cannot read config {str(path)!r}: {err}") from None
    from zerorun.planner.memory import Offload

    zero = cfg.zero
    offload: Offload
    optimizer_device = zero.offload_optimizer.device
    param_device = zero.offload_param.device
    if optimizer_device == "nvme":
        offload = "nvme"
    elif param_device == "cpu":
        offload = "cpu-optimizer+params"
    elif optimizer_device == "cpu":
        offload = "cpu-optimizer"
    else:
        offload = "none"
    training = Training(
        stage=zero.stage,
        precision=cfg.precision.dtype,
        offload=offload,
        reduce_bucket_size=int(zero.reduce_bucket_size),
        allgather_bucket_size=int(zero.allgather_bucket_size),
        prefetch_bucket_size=int(zero.prefetch_bucket_size),
        turn_prefetch_bucket_size=None if zero.turn_prefetch_bucket_size is None else int(zero.turn_prefetch_bucket_size),
        max_live_parameters=int(zero.max_live_parameters),
        param_persistence_threshold=int(zero.param_persistence_threshold),
        update_bucket_size=int(zero.update_bucket_size),
        nvme_buffer_count=int(zero.offload_optimizer.buffer_count),
        nvme_buffer_size=int(zero.offload_optimizer.buffer_size),
        nvme_params=param_device == "nvme",
        pin_memory=bool(zero.offload_optimizer.pin_memory),
        hpz_partition_size=int(zero.hpz_partition_size),
        leaf_modules=tuple(zero.leaf_modules),
    )
    activation = {
        "micro_batch": cfg.batch.micro_batch_size,
        "checkpointing": bool(cfg.activation_checkpointing.enabled),
    }
    return training, activation


def resolve_activations(request: EstimateRequest, file_activation: dict):
    from zerorun.planner.activations import ActivationJob

    micro_batch = request.micro_batch if request.micro_batch is not None else file_activation.get("micro_batch")
    checkpointing = request.activation_checkpointing
    if checkpointing is None:
        checkpointing = file_activation.get("checkpointing", False)
    seq_len = request.seq_len
    if micro_batch is None and seq_len is None:
        return None
    if micro_batch is None:
        raise PlannerError("activations need both --micro-batch and --seq-len")
    if seq_len is None:
        # A micro-batch without a length (every init template and config names one): a common
        # length rather than an error, said, so the activations row is not taken for the model's.
        seq_len = DEFAULT_SEQ_LEN
        print(f"zerorun: note: activations at --seq-len {DEFAULT_SEQ_LEN} (the default; give --seq-len for "
              "your model's)", file=sys.stderr)
    if micro_batch < 1 or seq_len < 1:
        raise PlannerError(f"--micro-batch and --seq-len must be positive (got {micro_batch}, {seq_len})")
    return ActivationJob(micro_batch=micro_batch, seq_len=seq_len, checkpointing=checkpointing)


DEFAULT_SEQ_LEN = 2048


def _run_measurement(request: EstimateRequest, plan, ranks: int, steps: int):
    if request.model is None:
        raise PlannerError("--measure needs --model module:function (the model to run)")
    if ranks < 1 or steps < 1:
        raise PlannerError("--measure-ranks and --measure-steps must be at least 1")
    from zerorun.planner.measure import measure_factory

    t = plan.training
    zero = {"reduce_bucket_size": t.reduce_bucket_size, "allgather_bucket_size": t.allgather_bucket_size,
            "prefetch_bucket_size": t.prefetch_bucket_size,
            "param_persistence_threshold": t.param_persistence_threshold, "leaf_modules": list(t.leaf_modules)}
    if t.turn_prefetch_bucket_size is not None:
        zero["turn_prefetch_bucket_size"] = t.turn_prefetch_bucket_size
    micro_batch = plan.activation_job.micro_batch if plan.activation_job else 2
    seq_len = plan.activation_job.seq_len if plan.activation_job else 16
    return measure_factory(request.model, plan, ranks=ranks, steps=steps, micro_batch=micro_batch,
                           seq_len=seq_len, config={"zero": zero})


def _traffic(plan, link: str | None, compute_s: float | None):
    """(rows, rate, ranks per host, compute seconds) for --link; None without it."""
    if link is None:
        if compute_s is not None:
            raise PlannerError("--compute-s needs --link", hint="add --link 300Mbit (the rate between hosts)")
        return None
    from zerorun.planner.traffic import all_traffic, kept_numel, parse_rate

    rate = parse_rate(link)
    if compute_s is not None and not compute_s > 0:
        raise PlannerError(f"--compute-s must be a positive number of seconds (got {compute_s})")
    param_bytes = 4 if plan.training.precision == "fp32" else 2
    kept = kept_numel(plan.model.shape, plan.training.prefetch_bucket_size, plan.model.num_params)
    rows = all_traffic(plan.model.num_params, plan.job, param_bytes, kept=kept, trained=plan.model.trained_params)
    return rows, rate, plan.job.gpus_per_node, compute_s


def _print(plan, measured, as_json: bool, traffic=None) -> None:
    from zerorun.planner.render import plan_to_json, render_plan, render_traffic, traffic_to_json

    if as_json:
        data = plan_to_json(plan)
        if measured is not None:
            data["measured"] = measured.to_json()
        if traffic is not None:
            data["traffic"] = traffic_to_json(*traffic)
        print(json.dumps(data, indent=2))
        return
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        # Piped or captured output: Rich would assume 80 columns and elide the numbers.
        console = Console(width=160)
    console.print(render_plan(plan))
    if measured is not None:
        from zerorun.planner.measure import render_measurement

        console.print(render_measurement(measured))
    if traffic is not None:
        console.print(render_traffic(*traffic))
