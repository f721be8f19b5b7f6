"""Training series for TensorBoard, CSV files and Weights & Biases, written by the launcher.

Note [one writer]: DeepSpeed writes its monitors from rank 0, which knows only its own memory
and communication. Here the launcher writes them, from the records the collector accepted:
it has every rank's step, memory and collective figures already, so one writer exports them
all and no training process imports tensorboard or wandb or spends a moment on them. Under
``srun ... zerorun`` only node 0's launcher (the one that sees the whole job) writes.

What opens the writers is the ``monitor`` section (DeepSpeed's ``tensorboard``, ``csv_monitor``
and ``wandb`` map onto it, with DeepSpeed's meanings: files in ``output_path/job_name``, a W&B
run in ``project`` / ``group`` / ``team``): from the launcher's ``--config`` at start, or from
rank 0's engine when the script passes its config to ``initialize`` itself (DeepSpeed-Chat's
``--enable_tensorboard`` builds its DeepSpeed dict in the script): a ``monitor`` record.

``SeriesBuilder`` is pure: records in, ``(tag, value, step)`` scalars out. A step's scalars are
written once every rank has reported that step and sent a sample after it (a worker sends its
steps in a burst just before each sample, so the sample that follows carries the memory and
collectives of those steps), or at the end with what there is:

    train/loss (mean of the ranks' own losses, as the dashboard's header), train/lr,
    train/loss_scale, train/step_time_s (the slowest rank's), train/samples_per_s and
    train/tokens_per_s (the job's: every rank's samples over the slowest step time);
    per rank r: rank{r}/loss, rank{r}/memory_bytes (GPU allocated on CUDA, RSS on CPU),
    rank{r}/memory_peak_bytes, rank{r}/comm_share (Note [comm share] in recorder.py),
    rank{r}/comm_bytes and rank{r}/comm_seconds (cumulative, every collective type),
    rank{r}/sent_within_host_bytes and rank{r}/sent_between_hosts_bytes (what the rank sent in
    that step on each link class, Note [bytes per link] in recorder.py), and their sums over
    the ranks that reported them, train/sent_within_host_bytes and train/sent_between_hosts_bytes.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Scalar = tuple[str, float, int]  # tag, value, step

# Which package each sink needs, and the extra that brings it.
NEEDS = {"tensorboard": "tensorboard", "wandb": "wandb"}


@dataclass
class _RankFigures:
    mem: dict = field(default_factory=dict)
    comm_bytes: int = 0
    comm_seconds: float = 0.0
    last_step: int = -1  # the highest step this rank reported
    sampled_through: int = -1  # the highest step it had reported when its latest sample came


class SeriesBuilder:
    """Accepted telemetry records -> scalars per completed step (pure; see the module docstring)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._ranks = {rank: _RankFigures() for rank in range(world_size)}
        self._pending: dict[int, dict[int, dict]] = {}  # step -> rank -> its step record

    def add(self, record: dict) -> list[Scalar]:
        rank, kind = record.get("rank"), record.get("kind")
        if rank not in self._ranks:
            return []
        figures = self._ranks[rank]
        if kind == "sample":
            figures.mem = record.get("mem") or figures.mem
            for count_bytes_seconds in (record.get("comm") or {}).values():
                figures.comm_bytes += int(count_bytes_seconds[1])
                figures.comm_seconds += float(count_bytes_seconds[2])
            figures.sampled_through = figures.last_step
        elif kind == "step":
            step = record["step"]
            figures.last_step = max(figures.last_step, step)
            self._pending.setdefault(step, {})[rank] = record
        else:
            return []
        sampled = min(f.sampled_through for f in self._ranks.values())
        out: list[Scalar] = []
        for step in sorted(self._pending):
            if step > sampled or len(self._pending[step]) < self.world_size:
                break
            out += self._emit(step)
        return out

    def flush(self) -> list[Scalar]:
        """The steps not every rank reported (a failed or stopped job), with the ranks that did."""
        out: list[Scalar] = []
        for step in sorted(self._pending):
            out += self._emit(step)
        return out

    def _emit(self, step: int) -> list[Scalar]:
        records = self._pending.pop(step)
        out: list[Scalar] = []
        losses = [r["loss"] for r in records.values() if r.get("loss") is not None]
        if losses and len(losses) == len(records):
            out.append(("train/loss", sum(losses) / len(losses), step))
        first = records[min(records)]
        for key in ("lr", "loss_scale"):
            if first.get(key) is not None:
                out.append((f"train/{key}", float(first[key]), step))
        slowest = max(r["step_time_s"] for r in records.values())
        out.append(("train/step_time_s", slowest, step))
        for key in ("samples", "tokens"):
            counts = [r.get(key) for r in records.values()]
            if slowest > 0 and all(c is not None for c in counts):
                out.append((f"train/{key}_per_s", sum(float(c or 0) for c in counts) / slowest, step))
        out += _link_series(records, step)
        for rank, record in sorted(records.items()):
            figures = self._ranks[rank]
            if record.get("loss") is not None:
                out.append((f"rank{rank}/loss", float(record["loss"]), step))
            used, peak = memory_figures(figures.mem)
            if used is not None:
                out.append((f"rank{rank}/memory_bytes", float(used), step))
            if peak is not None:
                out.append((f"rank{rank}/memory_peak_bytes", float(peak), step))
            if record.get("waited_s") is not None and record["step_time_s"] > 0:
                out.append((f"rank{rank}/comm_share", record["waited_s"] / record["step_time_s"], step))
            out.append((f"rank{rank}/comm_bytes", float(figures.comm_bytes), step))
            out.append((f"rank{rank}/comm_seconds", figures.comm_seconds, step))
        return out


LINK_CLASSES = (("sent_within", "sent_within_host_bytes"), ("sent_between", "sent_between_hosts_bytes"))


def _link_series(records: dict[int, dict], step: int) -> list[Scalar]:
    """Bytes each rank sent in ``step`` on each link class, and the job's sum of them (a rank of a
    script that never built an engine reports none, and is left out of both)."""
    out: list[Scalar] = []
    for key, name in LINK_CLASSES:
        sent = {rank: float(r[key]) for rank, r in sorted(records.items()) if r.get(key) is not None}
        if sent:
            out.append((f"train/{name}", sum(sent.values()), step))
        out += [(f"rank{rank}/{name}", value, step) for rank, value in sent.items()]
    return out


def memory_figures(mem: dict) -> tuple[float | None, float | None]:
    """(in use, peak): GPU allocated on CUDA, RSS on CPU (the dashboard's figure)."""
    if "cuda_allocated" in mem:
        return mem.get("cuda_allocated"), mem.get("cuda_peak")
    return mem.get("rss"), mem.get("rss_peak")


def log_dir(output_path: str, job_name: str, base: Path) -> Path:
    """DeepSpeed's folder: ``output_path/job_name``, relative to ``base`` (where zerorun started)."""
    return (base / os.path.expanduser(output_path or "") / job_name).resolve()


def missing_packages(section: dict) -> list[str]:
    """The packages the enabled sinks of a ``monitor`` section (as a dict) need and lack."""
    return [package for name, package in NEEDS.items()
            if (section.get(name) or {}).get("enabled") and importlib.util.find_spec(package) is None]


# --- sinks: each takes a batch of scalars and is closed once ---------------------------------


class TensorBoardSink:
    """Event files through tensorboard's own writer (no torch import in the launcher)."""

    def __init__(self, directory: Path):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._writer = EventFileWriter(str(directory))

    def write(self, scalars: list[Scalar]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        now = time.time()
        for tag, value, step in scalars:
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
            self._writer.add_event(Event(wall_time=now, step=step, summary=summary))

    def close(self) -> None:
        self._writer.close()


class CsvSink:
    """DeepSpeed's csv_monitor layout: one ``<tag with / as _>.csv`` per series, ``step,<tag>``.

    Rows are kept and appended every few seconds and at the end: one open per file per flush,
    not per step (a job of 64 ranks has some 400 series)."""

    FLUSH_S = 5.0

    def __init__(self, directory: Path, clock: Callable[[], float] = time.monotonic):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._rows: dict[str, list[tuple[int, float]]] = {}
        self._clock = clock
        self._flushed = clock()

    def write(self, scalars: list[Scalar]) -> None:
        for tag, value, step in scalars:
            self._rows.setdefault(tag, []).append((step, value))
        if self._clock() - self._flushed >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        self._flushed = self._clock()
        rows, self._rows = self._rows, {}
        for tag, values in rows.items():
            path = self.directory / (tag.replace("/", "_") + ".csv")
            new = not path.exists()
            with open(path, "a", encoding="utf-8") as f:
                if new:
                    f.write(f"step,{tag}\n")
                f.writelines(f"{step},{value!r}\n" for step, value in values)

    def close(self) -> None:
        self.flush()


class WandbSink:
    """A W&B run (``wandb.init(project, group, entity=team, name=job_name)``); WANDB_MODE=offline
    and the other WANDB_ variables act as wandb documents them."""

    def __init__(self, project: str, group: str | None, team: str | None, name: str | None, directory: Path):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self.run = wandb.init(project=project, group=group, entity=team, name=name, dir=str(directory))

    def write(self, scalars: list[Scalar]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for tag, value, step in scalars:
            by_step.setdefault(step, {})[tag] = value
        for step in sorted(by_step):
            self.run.log(by_step[step], step=step)

    def close(self) -> None:
        self.run.finish()


def open_sinks(section: dict, base: Path, run_dir: Path) -> tuple[list[Any], list[str]]:
    """The sinks a ``monitor`` section (as a dict) asks for, and one line per sink that could not
    open (a missing package, a folder that cannot be made): the job goes on without it."""
    sinks: list[Any] = []
    problems: list[str] = []
    tensorboard, csv, wandb = (section.get(name) or {} for name in ("tensorboard", "csv", "wandb"))
    makers: list[tuple[str, Callable[[], Any]]] = []
    if tensorboard.get("enabled"):
        makers.append(("tensorboard", lambda: TensorBoardSink(
            log_dir(tensorboard.get("output_path", ""), tensorboard.get("job_name") or "DeepSpeedJobName", base))))
    if csv.get("enabled"):
        makers.append(("csv", lambda: CsvSink(
            log_dir(csv.get("output_path", ""), csv.get("job_name") or "DeepSpeedJobName", base))))
    if wandb.get("enabled"):
        makers.append(("wandb", lambda: WandbSink(
            wandb.get("project") or "deepspeed", wandb.get("group"), wandb.get("team"),
            tensorboard.get("job_name") if tensorboard.get("enabled") else None, run_dir)))
    for name, make in makers:
        package = NEEDS.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            problems.append(f"monitor.{name} needs the {package} package (pip install 'zerorun[monitor]'"
                            f"{' wandb' if package == 'wandb' else ''}); not written")
            continue
        try:
            sinks.append(make())
        except Exception as exc:  # a third-party writer: whatever it raises, the job goes on
            problems.append(f"monitor.{name} could not start: {type(exc).__name__}: {exc}; not written")
    return sinks, problems


class Monitor:
    """The launcher's writer: accepted records in (``add``), every open sink written, ``close`` at
    the end. Thread-safe through the collector's lock, which calls ``add``."""

    def __init__(self, world_size: int, sinks: list[Any], warn: Callable[[str], None] | None = None):
        self.builder = SeriesBuilder(world_size)
        self.sinks = sinks
        self._warn = warn or (lambda text: print(f"zerorun: warning: {text}", file=sys.stderr, flush=True))

    def add(self, record: dict) -> None:
        self._write(self.builder.add(record))

    def close(self) -> None:
        self._write(self.builder.flush())
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:
                self._warn(f"{type(sink).__name__} did not close cleanly: {exc}")
        self.sinks = []

    def _write(self, scalars: list[Scalar]) -> None:
        if not scalars:
            return
        for sink in list(self.sinks):
            try:
                sink.write(scalars)
            except Exception as exc:  # a full disk ends that sink, never the job
                self._warn(f"{type(sink).__name__} stopped writing: {type(exc).__name__}: {exc}")
                self.sinks.remove(sink)
