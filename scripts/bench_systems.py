"""Shared by scripts/bench_cpu.py and scripts/bench_gpu.py (not run on its own).

Each data-parallel system the benchmarks compare is wrapped into the same small interface, so
the timing loop is one piece of code for all of them:

    trainer = build_trainer(system, model, lr, precision)   # inside an initialised process group
    loss = trainer.step(tokens, targets)                    # forward + backward + optimizer step
    trainer.model_state_bytes()                             # params + grads + optimizer state held

Systems: "ddp" (torch DistributedDataParallel), "fsdp2" / "fsdp2-noreshard" (torch
``fully_shard`` with reshard_after_forward True / False, one unit per transformer block plus the
root), "zero0".."zero3" (zerorun at that stage, "+cpu" etc. for offload) and, where DeepSpeed is
installed, "ds1".."ds3" and "ds2+cpu" (ZeRO-Offload). ``call(module, tokens, targets) -> loss``
says how a model is called (a Hugging Face model takes ``input_ids=``, ``labels=``); ``fused``
gives every system the same AdamW kernel (None: fused on CUDA only, the previous default). Also the measurement plumbing: one fresh
world of spawned processes per system (so memory peaks never leak from one system into the
next), per-step timing, and peak resident memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

SYSTEMS = ("ddp", "fsdp2", "fsdp2-noreshard", "zero0", "zero1", "zero2", "zero3")
DEEPSPEED = ("ds1", "ds2", "ds3", "ds2+cpu")
# zerorun with offload: "zero2+cpu", "zero3+cpu+params", "zero2+nvme" ... (scripts/bench_offload.py)
OFFLOADS = {"cpu": {"offload_optimizer": {"device": "cpu"}},
            "nvme": {"offload_optimizer": {"device": "nvme"}},
            "params": {"offload_param": {"device": "cpu"}},
            # ZeRO++ (scripts/bench_link.py): quantized weight gathers and gradient reduce-scatters
            "qwz": {"quantized_weights": True},
            "qgz": {"quantized_gradients": True},
            # a tied embedding's lookup reads and sends rows (zero/lookup_rows.py, zero/lookup_gradients.py)
            "rows": {"tied_embedding_rows": True},
            # ZeRO++ hpZ: its partition size is the ranks per host, which scripts/bench_link.py sets
            "hpz": {}}


def zerorun_system_config(system: str) -> dict:
    """``zero3+cpu+params`` -> {"zero": {"stage": 3, "offload_optimizer": ..., "offload_param": ...}}."""
    stage, *extras = system[len("zero"):].split("+")
    zero: dict = {"stage": int(stage)}
    for extra in extras:
        zero.update(OFFLOADS[extra])
    return {"zero": zero}


def is_system(name: str) -> bool:
    if name in SYSTEMS or name in DEEPSPEED:
        return True
    try:
        zerorun_system_config(name)
    except (KeyError, ValueError):
        return False
    return name.startswith("zero")


# --- the uniform trainer interface -------------------------------------------------------------


class Trainer:
    def __init__(self, model: nn.Module, optimizer, forward: Callable, autocast_dtype=None):
        self.model = model
        self.optimizer = optimizer
        self._forward = forward
        self._autocast_dtype = autocast_dtype

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with _autocast(tokens.device, self._autocast_dtype):
            loss = self._forward(tokens, targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def model_state_bytes(self) -> int:
        tensors = []
        for param in self.model.parameters():
            tensors.append(_local(param))
            if param.grad is not None:
                tensors.append(_local(param.grad))
        for state in self.optimizer.state.values():
            tensors.extend(_local(v) for v in state.values() if torch.is_tensor(v))
        return _unique_bytes(tensors)


def call_positionally(module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return module(tokens, targets)


class ZerorunTrainer:
    """zerorun's engine, or DeepSpeed's (the same three calls)."""

    def __init__(self, engine, call: Callable = call_positionally):
        self.engine = engine
        self.call = call

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.call(self.engine, tokens, targets)
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def model_state_bytes(self) -> int:
        breakdown = getattr(self.engine, "memory_breakdown", None)
        return int(breakdown()["total"]) if breakdown is not None else 0


def build_trainer(system: str, model: nn.Module, *, lr: float, precision: str = "fp32",
                  block_class: type | None = None, zerorun_config: dict | None = None,
                  call: Callable = call_positionally, fused: bool | None = None):
    """Wrap ``model`` (already on its device, same init on every rank) for ``system``."""
    amp_dtype = {"fp32": None, "bf16": torch.bfloat16}[precision]
    device = model_device(model)
    fused = device.type == "cuda" if fused is None else fused
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [device] if device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids)
        optimizer = _adamw(model.parameters(), lr, fused)
        return Trainer(wrapped, optimizer, lambda t, y: call(wrapped, t, y), autocast_dtype=amp_dtype)
    if system.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        reshard = system == "fsdp2"
        policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=amp_dtype) if amp_dtype else MixedPrecisionPolicy()
        blocks = [m for m in model.modules() if block_class is not None and isinstance(m, block_class)]
        for block in blocks:
            fully_shard(block, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
        optimizer = _adamw(model.parameters(), lr, fused)
        return Trainer(model, optimizer, lambda t, y: call(model, t, y))
    if system.startswith("zero"):
        import zerorun

        config = zerorun_system_config(system)
        if precision != "fp32":
            config["precision"] = {"dtype": precision}
        _merge(config, zerorun_config or {})
        return ZerorunTrainer(zerorun.initialize(model, _adamw(model.parameters(), lr, fused), config), call)
    if system in DEEPSPEED:
        return ZerorunTrainer(_deepspeed_engine(system, model, lr, precision, fused), call)
    raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS + DEEPSPEED)}")


def _deepspeed_engine(system: str, model: nn.Module, lr: float, precision: str, fused: bool):
    """DeepSpeed at the stage ``system`` names, bf16 as asked. Its ZeRO-Offload steps on the host
    with its own CPU Adam (it refuses another optimizer there); otherwise the same torch AdamW as
    every other system."""
    import deepspeed

    stage, *extras = system[len("ds"):].split("+")
    zero: dict = {"stage": int(stage)}
    config: dict = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
                    "bf16": {"enabled": precision == "bf16"}, "steps_per_print": 10**9}
    if "cpu" in extras:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": lr}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        engine, *_ = deepspeed.initialize(model=model, optimizer=_adamw(model.parameters(), lr, fused), config=config)
    return engine


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _adamw(params, lr: float, fused: bool):
    # The fused kernel is PyTorch's fastest AdamW on CUDA (GUIDE §5's peer uses it) and on the
    # host (Note [host optimizer kernels]); bench_cpu.py keeps the CPU's default (foreach).
    return torch.optim.AdamW(params, lr=lr, fused=True) if fused else torch.optim.AdamW(params, lr=lr)


def _autocast(device: torch.device, dtype):
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def _merge(into: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank actually holds (an FSDP2 DTensor's local shard)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    seen, total = set(), 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen and storage.nbytes():
            seen.add(key)
            total += storage.nbytes()
    return total


# --- measurement -------------------------------------------------------------------------------


class RssSampler:
    """Samples this process's resident set size in a thread: the peak while training runs."""

    def __init__(self, interval_s: float = 0.01):
        import psutil

        self._process = psutil.Process()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        self.peak = max(self.peak, self._process.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()


def lifetime_peak_rss_bytes() -> int:
    """This process's high-water resident memory since it started (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class RankResult:
    step_times_s: list[float]
    step_cpu_s: list[float]
    losses: list[float]
    peak_rss_bytes: int
    training_peak_rss_bytes: int
    model_state_bytes: int
    gpu_peak_bytes: int = 0
    gpu_reserved_bytes: int = 0
    extra: dict = field(default_factory=dict)


def time_steps(trainer, batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
               warmup: int, steps: int, synchronize: Callable[[], None]) -> RankResult:
    """Run warmup + steps optimizer steps; this rank's result (GPU fields left for the caller).

    Per timed step: wall seconds and CPU seconds of this process. CPU time is the less noisy
    figure on a shared machine: time spent waiting for a core does not count, time spent
    computing does. Also every step's loss, the peak RSS while training and over the process's
    life, and the trainer's model-state bytes after the last step.
    """
    times, cpu_times, losses = [], [], []
    with RssSampler() as sampler:
        for step in range(warmup + steps):
            tokens, targets = batches(step)
            synchronize()
            started, cpu_started = time.perf_counter(), time.process_time()
            loss = trainer.step(tokens, targets)
            synchronize()
            if step >= warmup:
                times.append(time.perf_counter() - started)
                cpu_times.append(time.process_time() - cpu_started)
            losses.append(loss.item())
    return RankResult(step_times_s=times, step_cpu_s=cpu_times, losses=losses,
                      peak_rss_bytes=lifetime_peak_rss_bytes(), training_peak_rss_bytes=sampler.peak,
                      model_state_bytes=trainer.model_state_bytes())


@dataclass
class SystemResult:
    system: str
    step_s: float | None = None
    step_cpu_s: float | None = None
    peak_rss_mib: float | None = None
    training_peak_rss_mib: float | None = None
    model_state_mib: float | None = None
    gpu_peak_gib: float | None = None
    gpu_reserved_gib: float | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    error: str | None = None


def summarize(system: str, ranks: list[dict]) -> SystemResult:
    """Step time = median over steps of the slowest rank; memory = the largest rank's."""
    per_step = [max(r["step_times_s"][i] for r in ranks) for i in range(len(ranks[0]["step_times_s"]))]
    mib = 1024 ** 2
    return SystemResult(
        system=system,
        step_s=statistics.median(per_step),
        step_cpu_s=statistics.median(statistics.mean(r["step_cpu_s"][i] for r in ranks)
                                     for i in range(len(ranks[0]["step_cpu_s"]))),
        peak_rss_mib=max(r["peak_rss_bytes"] for r in ranks) / mib,
        training_peak_rss_mib=max(r["training_peak_rss_bytes"] for r in ranks) / mib,
        model_state_mib=max(r["model_state_bytes"] for r in ranks) / mib,
        gpu_peak_gib=max(r["gpu_peak_bytes"] for r in ranks) / 1024 ** 3,
        gpu_reserved_gib=max(r.get("gpu_reserved_bytes", 0) for r in ranks) / 1024 ** 3,
        first_loss=ranks[0]["losses"][0],
        last_loss=ranks[0]["losses"][-1],
    )


def merge_repeats(results: list[SystemResult]) -> SystemResult:
    """One system measured in several interleaved rounds: the median round, peak of peaks."""
    good = [r for r in results if r.error is None]
    if not good:
        return results[0]
    merged = dataclasses.replace(good[0])
    for name in ("step_s", "step_cpu_s"):
        setattr(merged, name, statistics.median(getattr(r, name) for r in good))
    for name in ("peak_rss_mib", "training_peak_rss_mib", "model_state_mib", "gpu_peak_gib", "gpu_reserved_gib"):
        setattr(merged, name, max(getattr(r, name) for r in good))
    return merged


def run_world(rank_fn: Callable, world: int, system: str, options: dict, workdir: Path,
              preload: list[str] | None = None) -> SystemResult:
    """Run ``rank_fn(rank, world, system, options, init_file) -> RankResult`` in a fresh world.

    ``preload``: modules a fork server imports once, each world's ranks then forked from it (a
    fresh process all the same, with no CUDA context and no process group: the server only
    imported them), instead of every rank importing torch and transformers again."""
    import torch.multiprocessing as mp

    run_dir = workdir / system
    run_dir.mkdir(parents=True, exist_ok=True)
    if preload:
        mp.set_forkserver_preload(preload)
    try:
        mp.start_processes(_rank_entry, args=(rank_fn, world, system, options, str(run_dir)),
                           nprocs=world, start_method="forkserver" if preload else "spawn", join=True)
    except Exception as err:  # a failing system must not hide the others' numbers
        errors = sorted(run_dir.glob("error*.txt"))
        message = errors[0].read_text().strip().splitlines()[-1] if errors else str(err).strip().splitlines()[-1]
        return SystemResult(system=system, error=message[:200])
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(world)]
    return summarize(system, ranks)


def _rank_entry(rank: int, rank_fn, world: int, system: str, options: dict, run_dir: str) -> None:
    try:
        result = rank_fn(rank, world, system, options, os.path.join(run_dir, "rendezvous"))
        Path(run_dir, f"rank{rank}.json").write_text(json.dumps(result.__dict__))
    except BaseException:
        Path(run_dir, f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# --- reporting ---------------------------------------------------------------------------------


def ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def render_table(title: str, results: list[SystemResult], baseline: str, targets: dict, gpu: bool = False):
    """A Rich table: step time and memory, absolute and relative to ``baseline``."""
    from rich.table import Table

    base = next((r for r in results if r.system == baseline and r.error is None), None)
    table = Table(title=title)
    memory_field = "gpu_peak_gib" if gpu else "peak_rss_mib"
    for header in ("system", "step s", f"x{baseline}", "cpu s", f"x{baseline}", "GPU GiB" if gpu else "RSS MiB",
                   f"x{baseline}", "state MiB", "loss", "target"):
        table.add_column(header, justify="left" if header in ("system", "target") else "right", no_wrap=True)
    for r in results:
        if r.error:
            table.add_row(r.system, *["-"] * 8, "[red]failed (below)[/red]")
            continue
        step_ratio = ratio(r.step_s, base.step_s if base else None)
        memory = getattr(r, memory_field)
        mem_ratio = ratio(memory, getattr(base, memory_field) if base else None)
        cpu_ratio = ratio(r.step_cpu_s, base.step_cpu_s if base else None)
        table.add_row(
            r.system, f"{r.step_s:.3f}", _fmt(step_ratio), f"{r.step_cpu_s:.3f}", _fmt(cpu_ratio),
            f"{memory:.2f}" if gpu else f"{memory:.0f}",
            _fmt(mem_ratio), f"{r.model_state_mib:.0f}", f"{r.last_loss:.4f}",
            _verdict(targets.get(r.system, {}), step_ratio, mem_ratio),
        )
    return table


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _verdict(target: dict, step_ratio: float | None, mem_ratio: float | None) -> str:
    if not target or step_ratio is None:
        return ""
    parts = []
    if "step" in target:
        ok = step_ratio <= target["step"]
        parts.append(f"[{'green' if ok else 'red'}]t<={target['step']:.2f}[/]")
    if "memory" in target and mem_ratio is not None:
        ok = mem_ratio <= target["memory"]
        parts.append(f"[{'green' if ok else 'red'}]m<={target['memory']:.2f}[/]")
    return " ".join(parts)


def parse_shared_options(parser, args) -> None:
    """--systems and --zerorun-config, as bench_cpu.py and bench_gpu.py both take them."""
    import json

    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if not is_system(s)]
    if unknown:
        parser.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    try:
        args.zerorun_config = json.loads(args.zerorun_config)
    except json.JSONDecodeError as err:
        parser.error(f"--zerorun-config is not JSON: {err}")
