"""``zerorun estimate --model mod:build --measure``: run real steps and set the measured peak
beside the estimate.

One world of ``ranks`` processes is spawned (gloo on CPU, NCCL on GPUs, over a ``file://``
rendezvous in a temporary folder: no port) and trains the model for a few steps at every stage in turn, so the process
start-up is paid once. On CPU each rank reports its peak resident memory during the steps
minus its resident memory just before the model was built; on CUDA, the peak allocated bytes
minus those allocated before. Beside it: ``engine.memory_breakdown()`` (what the engine counts
in its own tensors) and the planner's estimate for the same world, stage and precision.

What the model is fed: ``example_batch(micro_batch, seq_len)`` from the factory's module when it
defines one (the positional inputs: a tensor or a tuple); otherwise token ids when the model's
first parametrised layer is an Embedding, features when it is a Linear. The loss is the model's
``.loss`` when it returns one, else the mean square of its (first) output.

Note [allocator]: glibc serves mid-sized allocations from heaps it keeps after ``free``, which
would hide later growth behind memory freed earlier. The workers are started with a fixed mmap
threshold (MALLOC_MMAP_THRESHOLD_), so every tensor of more than 64 KiB is its own mapping,
returned to the system when freed, and resident memory follows the live tensors.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from zerorun.errors import PlannerError

MEASURED_STAGES = (0, 1, 2, 3)
_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


@dataclass
class StageMeasurement:
    stage: int
    rank: int
    device: str
    config: dict                # the zerorun config of this run (stage set from ``stage``)
    measured_peak: int          # peak bytes during the steps, above the pre-model baseline
    breakdown: dict             # engine.memory_breakdown() around the last update (_largest_of)
    estimate_total: float       # planner: model state + buffers (+ activations when known)
    estimate_model_state: float

    @property
    def ratio(self) -> float:
        return self.estimate_total / self.measured_peak if self.measured_peak > 0 else float("inf")


@dataclass
class Measurement:
    ranks: int
    steps: int
    precision: str
    records: list[StageMeasurement]

    def to_json(self) -> dict:
        return {
            "ranks": self.ranks,
            "steps": self.steps,
            "precision": self.precision,
            "compared": "estimate (model state + buffers + activations) vs measured peak bytes "
                        "above the pre-model baseline (CPU: resident memory; CUDA: allocated)",
            "records": [asdict(r) | {"ratio": round(r.ratio, 4)} for r in self.records],
        }


def measure_factory(target: str, plan, *, ranks: int = 2, steps: int = 3, micro_batch: int = 2,
                    seq_len: int = 16, stages=MEASURED_STAGES, config: dict | None = None,
                    runs: list[tuple[int, dict]] | None = None) -> Measurement:
    """Spawn ``ranks`` workers that train ``target`` at each stage; compare with ``plan``'s model.

    ``runs`` (stage, config) pairs replace ``stages`` x ``config`` when given, so one world can
    check several bucket settings.
    """
    import torch.multiprocessing as mp

    from zerorun.planner.counting import load_factory

    load_factory(target)  # fail here, in one line, rather than in every worker
    _check_gpus(ranks)
    precision = plan.training.precision
    runs = runs or [(stage, config or {}) for stage in stages]
    with tempfile.TemporaryDirectory(prefix="zerorun-measure-") as tmp:
        saved = {k: os.environ.get(k) for k in _ALLOCATOR_ENV}
        os.environ.update(_ALLOCATOR_ENV)  # read by the children's libc at start (Note [allocator])
        try:
            mp.start_processes(
                _worker,
                args=(ranks, tmp, target, runs, precision, steps, micro_batch, seq_len),
                nprocs=ranks, join=True, start_method="spawn",
            )
        except mp.ProcessRaisedException as err:
            last = str(err).strip().splitlines()[-1]
            own = "zerorun.errors.PlannerError: "
            raise PlannerError(last[len(own):] if last.startswith(own) else f"--measure failed in a worker: {last}") from None
        except mp.ProcessExitedException as err:
            raise PlannerError(f"--measure: a worker died ({err})") from None
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        raw = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(ranks)]
    records = [_with_estimate(item, plan, ranks) for per_rank in raw for item in per_rank]
    return Measurement(ranks=ranks, steps=steps, precision=precision, records=records)


def _check_gpus(ranks: int) -> None:
    """On a GPU machine each rank needs a GPU of its own: NCCL refuses two ranks on one device."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if 0 < gpus < ranks:
        raise PlannerError(f"--measure-ranks {ranks} needs {ranks} GPUs (one NCCL rank per GPU); this machine has {gpus}",
                           hint=f"pass --measure-ranks {gpus} or fewer")


def _with_estimate(item: dict, plan, ranks: int) -> StageMeasurement:
    from zerorun.planner.memory import Job, estimate

    training = _training_for(plan.training, item["stage"], item["device"], item["config"])
    est = estimate(plan.model, Job(gpus_per_node=ranks), training, plan.activation_job)
    return StageMeasurement(
        stage=item["stage"], rank=item["rank"], device=item["device"], config=item["config"],
        measured_peak=item["measured_peak"], breakdown=item["breakdown"],
        estimate_total=est.gpu_total, estimate_model_state=est.model_state,
    )


def _training_for(base, stage: int, device: str, config: dict):
    zero = config.get("zero", {})
    fields = {k: zero[k] for k in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size", "turn_prefetch_bucket_size",
                                   "max_live_parameters", "param_persistence_threshold", "update_bucket_size") if k in zero}
    return replace(base, stage=stage, offload="none", device="cuda" if device.startswith("cuda") else "cpu", **fields)


# -- inside each worker ----------------------------------------------------------------------

def _worker(rank, world, tmp, target, runs, precision, steps, micro_batch, seq_len):
    import torch
    import torch.distributed as dist

    from zerorun.zero.comm.process_group import leaving_together

    torch.set_num_threads(1)  # ranks share the machine's cores; memory does not depend on it
    device = _worker_device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator and every allocation on this rank's GPU
    dist.init_process_group(_backend(device), init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    with leaving_together():  # Note [clean exit] in zerorun/zero/comm/process_group.py
        from zerorun.planner.counting import load_factory

        factory = load_factory(target)
        module = __import__(factory.__module__, fromlist=["_"])
        batch_fn = getattr(module, "example_batch", None)
        _warm_up(device)
        # The first real-size run also grows what is created once per process (gloo's transfer
        # buffers, the threads' allocator arenas): measured once and dropped, so that the first
        # stage measured pays no more of it than the others (stage 0 read 145-155 MB against
        # 138.5 estimated, depending on the machine, without this).
        first_stage, first_config = runs[0]
        _measure_stage(factory, batch_fn, first_stage, rank, device, precision, 1, micro_batch, seq_len, first_config)
        dist.barrier()
        results = []
        for stage, config in runs:
            results.append(_measure_stage(factory, batch_fn, stage, rank, device, precision, steps,
                                          micro_batch, seq_len, config))
            dist.barrier()
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(results))


def _backend(device) -> str:
    """NCCL on a GPU, as a training run there uses (Note [device contract] in worker/device.py):
    gloo with CUDA tensors works but is another program (its reduce-scatter clones its input on
    the GPU, and its transfers go through the host), so it would measure what no run does."""
    return "nccl" if device.type == "cuda" else "gloo"


def _worker_device(rank: int):
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _warm_up(device) -> None:
    """One tiny step per stage first, so lazily created runtime state (autograd threads, gloo
    buffers, allocator arenas) is already in the baseline of the real measurements."""
    import torch

    import zerorun

    for stage in (0, 3):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device)
        engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters()), {"zero": {"stage": stage}})
        engine.backward(engine(torch.randn(2, 8, device=device)).square().mean())
        engine.step()
        del engine, model
        gc.collect()


def _measure_stage(factory, batch_fn, stage, rank, device, precision, steps, micro_batch, seq_len, config):
    import torch

    import zerorun

    gc.collect()
    probe = _MemoryProbe(device)
    baseline = probe.current()
    torch.manual_seed(0)
    model = factory().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    zero = dict(config.get("zero", {}), stage=stage)
    engine = zerorun.initialize(model, optimizer, {**config, "zero": zero, "precision": {"dtype": precision}})
    inputs = _example_inputs(model, batch_fn, micro_batch, seq_len, device, seed=rank)
    gc.collect()
    probe.reset_peak()  # from here on: the training steps only
    for step in range(steps):
        try:
            output = engine(*inputs)
        except TypeError as exc:
            if batch_fn is not None:
                raise
            shapes = ", ".join(str(tuple(t.shape)) if hasattr(t, "shape") else type(t).__name__ for t in inputs)
            raise PlannerError(f"the model's forward refused the input --measure guessed ({shapes}): {exc}; "
                               "define example_batch(micro_batch, seq_len) beside the model function, returning "
                               "the forward's arguments (a tensor or a tuple)") from None
        loss = _loss_of(output)
        del output
        engine.backward(loss)
        if step == steps - 1:
            before_update = engine.memory_breakdown()
        engine.step()
        del loss
    peak = probe.peak()
    breakdown = _largest_of(before_update, engine.memory_breakdown())
    del engine, model, optimizer, inputs
    gc.collect()
    return {"stage": stage, "rank": rank, "device": str(device), "config": config,
            "measured_peak": int(peak - baseline), "breakdown": breakdown}


def _largest_of(before_update: dict, after_update: dict) -> dict:
    """Each category at its larger value around the last update: stage 3 has gradient shards
    only before it at stages 1-3 (Note [lazy gradient shards]), optimizer state is complete only after it
    (Adam creates its state in the first step)."""
    parts = {key: max(before_update[key], after_update[key]) for key in after_update if key != "total"}
    return parts | {"total": sum(parts.values())}


class _MemoryProbe:
    """Current and peak bytes: resident set on CPU (VmRSS / VmHWM, reset through clear_refs),
    allocated bytes on CUDA."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.device = device

    def current(self) -> int:
        if self.cuda:
            import torch

            return torch.cuda.memory_allocated(self.device)
        return _status_kib("VmRSS") * 1024

    def reset_peak(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
            return
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS

    def peak(self) -> int:
        if self.cuda:
            import torch

            return torch.cuda.max_memory_allocated(self.device)
        return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise PlannerError(f"--measure on CPU needs Linux's /proc/self/status ({field} missing)")


def _example_inputs(model, batch_fn, micro_batch, seq_len, device, seed):
    import torch

    generator = torch.Generator().manual_seed(seed)
    if batch_fn is not None:
        inputs = batch_fn(micro_batch, seq_len)
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        return tuple(t.to(device) if torch.is_tensor(t) else t for t in inputs)
    first = next((m for m in model.modules() if any(True for _ in m.parameters(recurse=False))), None)
    if isinstance(first, torch.nn.Embedding):
        ids = torch.randint(0, first.num_embeddings, (micro_batch, seq_len), generator=generator)
        return (ids.to(device),)
    if isinstance(first, torch.nn.Linear):
        return (torch.randn(micro_batch, first.in_features, generator=generator).to(device),)
    raise PlannerError(
        f"--measure cannot guess inputs for a model starting with {type(first).__name__}",
        hint="define example_batch(micro_batch, seq_len) beside the model function",
    )


def _loss_of(output):
    import torch

    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    if isinstance(output, (tuple, list)):
        output = next(t for t in output if torch.is_tensor(t))
    elif not torch.is_tensor(output):
        output = next(t for t in output.to_tuple() if torch.is_tensor(t))  # HF ModelOutput
    return output if output.dim() == 0 else output.float().square().mean()


def render_measurement(measurement: Measurement):
    from rich.table import Table

    from zerorun.planner.quantities import format_gb, table_unit

    unit, unit_name = table_unit(max((r.estimate_total for r in measurement.records), default=0))
    table = Table(
        title=(f"--measure: {measurement.ranks} ranks, {measurement.steps} steps, {measurement.precision}; "
               f"{unit_name} (decimal) per rank; measured = peak above the pre-model baseline; "
               "estimate = model state + buffers (+ activations when known) for this device"),
        title_justify="left",
    )
    for header in ("stage", "rank", "device", "estimate", "measured peak", "estimate/measured",
                   "engine: model state", "engine: buffers"):
        table.add_column(header, justify="right")
    for r in measurement.records:
        b = r.breakdown
        state = b.get("parameters", 0) + b.get("gradients", 0) + b.get("optimizer_state", 0)
        table.add_row(str(r.stage), str(r.rank), r.device, format_gb(r.estimate_total, unit),
                      format_gb(r.measured_peak, unit), f"{r.ratio:.2f}", format_gb(state, unit),
                      format_gb(b.get("communication_buffers", 0), unit))
    return table
